"""Decode attention vs KV split count (issue 17): one unified_attention call (merge kernel included) per
(batch, context, splits) at the Qwen3-0.6B shape, timed under CUDA graphs with layer caches rotated past L2, next to
what choose_num_splits picks now. CPU (interpreter, fp16, tiny heads) only with --quick.
Example: python tools/bench_attention_splits.py --json bench_attention_splits.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, which puts the repo root on sys.path
import bench_common
import torch
from bench_kernels import time_us

from graphrunner.attention import triton_attention
from graphrunner.attention.metadata import AttentionMetadata
from graphrunner.attention.reference import paged_attention_ref
from graphrunner.attention.triton_attention import choose_num_splits, query_tiles, unified_attention
from graphrunner.config import CacheConfig

L2_BYTES = 256 << 20  # rotate layer caches over at least this much touched KV (H200 L2: 50 MB)
MAX_COPIES = 1024     # cap on rotated caches (b=1, ctx=128 touches 512 KB: 512 copies)


def _batch(b: int, ctx: int, hq: int, hkv: int, dim: int, block_size: int, dtype: torch.dtype,
           device: torch.device, copies: int, seed: int,
           q_len: int = 1) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A step of b requests of q_len new tokens each (1: decode) ending at context ctx: metadata, `copies` layer
    caches [copies, 2, NB, bs, Hkv, D] and q [b * q_len, Hq, D]."""
    g = torch.Generator().manual_seed(seed)
    per_req = -(-ctx // block_size)
    num_blocks = b * per_req + 1 + b  # block 0 is the null block; a little slack, as in a real pool
    blocks = (torch.randperm(num_blocks - 1, generator=g)[:b * per_req] + 1).view(b, per_req)  # distinct, scattered
    caches = torch.randn(copies, 2, num_blocks, block_size, hkv, dim, device=device, dtype=dtype)
    query = torch.randn(b * q_len, hq, dim, generator=g).to(device=device, dtype=dtype)
    meta = AttentionMetadata(
        num_reqs=b, num_tokens=b * q_len, max_query_len=q_len, max_seq_len=ctx, block_size=block_size,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device) * q_len,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
        block_table=blocks.to(device=device, dtype=torch.int32),
        slot_mapping=torch.full((b * q_len,), -1, dtype=torch.int64, device=device),  # unused: nothing is written
        query_lens_cpu=[q_len] * b, seq_lens_cpu=[ctx] * b)
    return meta, caches, query


def bench(batch_sizes: list[int], contexts: list[int], splits: list[int], hq: int, hkv: int, dim: int,
          block_size: int, dtype: torch.dtype, device: torch.device, reps: int, per_graph: int,
          max_model_len: int, q_len: int = 1) -> tuple[list[dict], list[dict]]:
    rows, summary = [], []
    scale = dim ** -0.5
    for b in batch_sizes:
        for ctx in contexts:
            kv_bytes = b * ctx * hkv * dim * 2 * dtype.itemsize  # K and V actually read per call
            copies = min(MAX_COPIES, max(1, -(-L2_BYTES // kv_bytes))) if device.type == "cuda" else 1
            meta, caches, query = _batch(b, ctx, hq, hkv, dim, block_size, dtype, device, copies, seed=b * 7919 + ctx,
                                         q_len=q_len)
            tiles = b * query_tiles(q_len, hq // hkv)  # what the metadata builder counts (1 per decode)
            current = choose_num_splits(tiles, hkv, ctx)
            # FULL CUDA graphs (capture/manager.py) run the split count of max_model_len once current > 1.
            full_graph = choose_num_splits(tiles, hkv, max_model_len) if current > 1 else 1
            todo = sorted({s for s in (*splits, current, full_graph) if 1 <= s <= triton_attention.MAX_SPLITS})
            outs = {s: torch.empty_like(query) for s in todo}
            ref = paged_attention_ref(query.float(), caches[0].float(), meta, scale)
            timings: dict[int, float] = {}
            for s in todo:
                unified_attention(query, caches[0], meta, scale, num_splits=s, out=outs[s])
                diff = (outs[s].float() - outs[1].float()).abs().max().item() if 1 in outs else float("nan")
                err = (outs[s].float() - ref).abs().max().item()
                out = torch.empty_like(query)
                us = time_us([partial(unified_attention, query, c, meta, scale, num_splits=s, out=out) for c in caches],
                             device, reps, per_graph)
                timings[s] = us
                row = {"batch": b, "ctx": ctx, "splits": s, "us": us, "kv_GBps": kv_bytes / (us * 1e3),
                       "max_abs_diff_vs_s1": diff, "max_abs_err_vs_ref": err, "cache_copies": copies,
                       "current_pick": s == current, "full_graph_pick": s == full_graph,
                       "requested": s in splits}
                rows.append(row)
                print(f"b={b:<2} ctx={ctx:<5} s={s:<2} {us:8.2f} us {row['kv_GBps']:7.0f} GB/s   "
                      f"diff vs s=1 {diff:.2e}  err vs ref {err:.2e}" + (" *" if s == current else ""), flush=True)
            best = min(timings, key=timings.__getitem__)
            entry = {"batch": b, "ctx": ctx, "best_splits": best, "best_us": timings[best], "current_splits": current,
                     "current_us": timings[current], "full_graph_splits": full_graph,
                     "full_graph_us": timings[full_graph], "speedup_best_vs_current": timings[current] / timings[best]}
            summary.append(entry)
            print(f"b={b:<2} ctx={ctx:<5} best s={best} {timings[best]:.2f} us; choose_num_splits picks s={current} "
                  f"{timings[current]:.2f} us ({entry['speedup_best_vs_current']:.2f}x); FULL graph "
                  f"(max_model_len {max_model_len}) s={full_graph} {timings[full_graph]:.2f} us", flush=True)
            del caches, outs
    return rows, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--contexts", default="128,330,512,1024,2048,4096", help="keys per request (seq_lens)")
    ap.add_argument("--splits", default="1,2,4,8,16", help="split counts (above MAX_SPLITS: skipped); choose_num_"
                    "splits' picks are always added")
    ap.add_argument("--max-model-len", type=int, default=40960,
                    help="for the FULL-graph split count (Qwen3-0.6B config: 40960)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing (median)")
    ap.add_argument("--per-graph", type=int, default=64, help="calls per graph (at least one per cache copy)")
    ap.add_argument("--query-len", type=int, default=1,
                    help="new tokens per request (1: decode; e.g. 64 over --contexts 4160: a prefix-cache hit)")
    ap.add_argument("--split-rows", type=int, default=0, choices=(0, 64, 128),
                    help="tile rows of a split prefill launch (0: the engine's GRAPHRUNNER_ATTN_SPLIT_ROWS)")
    ap.add_argument("--max-splits", type=int, default=0,
                    help="raise the kernel's split cap for this run (0: the engine's GRAPHRUNNER_ATTN_MAX_SPLITS)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run of the script)")
    ap.add_argument("--json", default="bench_attention_splits.json")
    args = ap.parse_args()
    device = bench_common.resolve_device(args.device)
    batch_sizes, contexts = bench_common.parse_int_list(args.batch_sizes), bench_common.parse_int_list(args.contexts)
    if args.split_rows:
        triton_attention.SPLIT_PREFILL_ROWS = args.split_rows
    if args.max_splits:
        triton_attention.MAX_SPLITS = args.max_splits
    splits = [s for s in bench_common.parse_int_list(args.splits) if 1 <= s <= triton_attention.MAX_SPLITS]
    hq, hkv, dim, per_graph = 16, 8, 128, args.per_graph  # Qwen3-0.6B attention
    # The interpreter multiplies bf16 tl.dot operands as raw bits (see tests/test_attention_triton.py): fp16 on CPU.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    if args.quick:
        batch_sizes, contexts, splits, hq, hkv, dim, per_graph = [1, 2], [5, 70], [1, 3], 4, 2, 32, 2
    block_size = CacheConfig.block_size  # the engine's default (16)
    constants = {"SPLIT_MIN_SEQ_LEN": triton_attention.SPLIT_MIN_SEQ_LEN,
                 "SPLIT_MIN_KEYS": triton_attention.SPLIT_MIN_KEYS, "MAX_SPLITS": triton_attention.MAX_SPLITS,
                 "_TARGET_PROGRAMS": triton_attention._TARGET_PROGRAMS,
                 "SPLIT_PREFILL_ROWS": triton_attention.SPLIT_PREFILL_ROWS, "query_len": args.query_len}
    print(f"heads {hq}/{hkv} x {dim}, {dtype}, block_size {block_size}, {device}; {constants}", flush=True)
    rows, summary = bench(batch_sizes, contexts, splits, hq, hkv, dim, block_size, dtype, device, args.reps,
                          per_graph, args.max_model_len, args.query_len)
    result: dict[str, Any] = {"script": "bench_attention_splits", "env": bench_common.env_info(), "args": vars(args),
                              "shape": {"num_heads": hq, "num_kv_heads": hkv, "head_dim": dim, "dtype": str(dtype),
                                        "block_size": block_size},
                              "constants": constants, "rows": rows, "summary": summary}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
