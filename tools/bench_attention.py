"""Attention micro-benchmark: Triton unified_attention vs torch SDPA on the same K/V laid out contiguously.

Decode (batch 1/32/256 x context 512/2K/8K) and one-request prefill (512/4K) at the Qwen3-0.6B attention shape:
median CUDA-event times, GB/s or TFLOP/s and % of the card's measured copy/matmul peaks. Needs CUDA."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, which puts the repo root on sys.path
import bench_common

from graphrunner.attention.metadata import AttentionMetadata
from graphrunner.attention.triton_attention import choose_num_splits, unified_attention

FLUSH_BYTES = 256 << 20  # written between timed calls so no K/V is served from the 60 MB L2


USE_GRAPHS = True  # --no-graph turns it off


def time_ms(fn: Callable[[], Any], iters: int, warmup: int, flush: torch.Tensor) -> float:
    """Median CUDA-event milliseconds of fn() over `iters` calls, each after an L2 flush. fn is captured into a
    CUDA graph and replayed, so the figure is device time only (as inside the engine's graphs); the Python
    custom op's host cost (checks, allocation, launches) is larger than the flush for small cases."""
    call = fn
    if USE_GRAPHS:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        call = graph.replay
    return bench_common.median_ms(call, torch.device("cuda"), iters, warmup, before=flush.zero_)


def measure_peaks(flush: torch.Tensor, nbytes: int = 2 << 30, n: int = 8192) -> dict[str, float]:
    """Device-to-device copy bandwidth of `nbytes` (bytes read + written) and the bf16 n^3 matmul rate."""

    def copy_ms() -> float:
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return time_ms(lambda: dst.copy_(src), 10, 3, flush)

    def matmul_ms() -> float:
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        return time_ms(lambda: a @ b, 10, 3, flush)

    peaks = {"copy_GBps": 2 * nbytes / copy_ms() / 1e6, "bf16_matmul_TFLOPs": 2 * n ** 3 / matmul_ms() / 1e9}
    torch.cuda.empty_cache()
    return peaks


def build_case(query_len: int, num_reqs: int, context: int, hq: int, hkv: int, dim: int, block_size: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
    """num_reqs requests of `context` tokens each (the last query_len are the queries) on shuffled blocks.
    Returns query [T, Hq, D], layer_cache, metadata and the same K/V contiguous as [B, Hkv, context, D]."""
    assert context % block_size == 0
    nblk = context // block_size
    num_blocks = num_reqs * nblk + 1  # block 0: the null block
    cache = torch.randn(2, num_blocks, block_size, hkv, dim, dtype=dtype, device="cuda")
    table = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(num_reqs, nblk).to(torch.int32)
    t = num_reqs * query_len
    query = torch.randn(t, hq, dim, dtype=dtype, device="cuda")
    pos = torch.arange(context - query_len, context, device="cuda")
    slots = (table[:, pos // block_size].long() * block_size + pos % block_size).flatten()
    meta = AttentionMetadata(
        num_reqs=num_reqs, num_tokens=t, max_query_len=query_len, max_seq_len=context, block_size=block_size,
        query_start_loc=torch.arange(0, t + 1, query_len, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((num_reqs,), context, dtype=torch.int32, device="cuda"),
        block_table=table, slot_mapping=slots, query_lens_cpu=[query_len] * num_reqs,
        seq_lens_cpu=[context] * num_reqs)
    k, v = (cache[i][table.long()].view(num_reqs, context, hkv, dim).transpose(1, 2).contiguous() for i in (0, 1))
    return query, cache, meta, k, v


def run_case(kind: str, num_reqs: int, context: int, args: argparse.Namespace, peaks: dict[str, float],
             flush: torch.Tensor) -> dict[str, Any]:
    hq, hkv, dim, dtype = args.num_heads, args.num_kv_heads, args.head_dim, torch.bfloat16
    q_len = 1 if kind == "decode" else context
    query, cache, meta, k, v = build_case(q_len, num_reqs, context, hq, hkv, dim, args.block_size, dtype)
    scale = dim ** -0.5
    # the layer's rule: choose_num_splits for decode-only batches, one split otherwise
    splits = choose_num_splits(num_reqs, hkv, context) if kind == "decode" else 1
    q4 = query.view(num_reqs, q_len, hq, dim).transpose(1, 2)  # [B, Hq, q, D]

    def ours(s: int = splits) -> torch.Tensor:
        return unified_attention(query, cache, meta, scale, num_splits=s)

    def peer() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, is_causal=kind == "prefill", scale=scale, enable_gqa=True)

    max_diff = float((ours().float() - peer().transpose(1, 2).reshape(query.shape).float()).abs().max())
    ours_ms = time_ms(ours, args.iters, args.warmup, flush)
    peer_ms = time_ms(peer, args.iters, args.warmup, flush)
    row: dict[str, Any] = {"kind": kind, "batch": num_reqs, "context": context, "query_len": q_len,
                           "num_splits": splits, "ours_ms": ours_ms, "sdpa_ms": peer_ms, "max_abs_diff": max_diff}
    if kind == "decode":
        if splits > 1:
            row["ours_1split_ms"] = time_ms(lambda: ours(1), args.iters, args.warmup, flush)
        nbytes = 2 * k.numel() * k.element_size() + 2 * query.numel() * query.element_size()  # K+V read, q + out
        row["bytes"] = nbytes
        for who in ("ours", "sdpa"):
            gbps = nbytes / row[f"{who}_ms"] / 1e6
            row[f"{who}_GBps"], row[f"{who}_pct_peak"] = gbps, 100 * gbps / peaks["copy_GBps"]
    else:
        flops = 4 * q_len * context * dim * hq / 2  # QK^T and PV, half of the square under the causal mask
        row["flops"] = flops
        for who in ("ours", "sdpa"):
            tflops = flops / row[f"{who}_ms"] / 1e9
            row[f"{who}_TFLOPs"], row[f"{who}_pct_peak"] = tflops, 100 * tflops / peaks["bf16_matmul_TFLOPs"]
    return row


def print_row(r: dict[str, Any]) -> None:
    unit = "GBps" if r["kind"] == "decode" else "TFLOPs"
    one = f"{r['ours_1split_ms']:8.4f}" if "ours_1split_ms" in r else f"{'-':>8}"
    print(f"{r['kind']:<8}{r['batch']:>6}{r['context']:>7}{r['num_splits']:>7} {r['ours_ms']:9.4f} {one} "
          f"{r['sdpa_ms']:9.4f} {r[f'ours_{unit}']:9.1f} {r['ours_pct_peak']:6.1f}% {r[f'sdpa_{unit}']:9.1f} "
          f"{r['sdpa_pct_peak']:6.1f}% {r['sdpa_ms'] / r['ours_ms']:6.2f}x {r['max_abs_diff']:9.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-batches", default="1,32,256")
    ap.add_argument("--decode-contexts", default="512,2048,8192")
    ap.add_argument("--prefill-lens", default="512,4096")
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default="bench_attention.json", help="where to write the results (default %(default)s)")
    ap.add_argument("--no-graph", action="store_true", help="time plain calls (host time included at small sizes)")
    args = ap.parse_args()
    global USE_GRAPHS
    USE_GRAPHS = not args.no_graph
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU: torch.cuda.is_available() is False")
    torch.manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    peaks = measure_peaks(flush)
    print(f"{torch.cuda.get_device_name()}: copy {peaks['copy_GBps']:.0f} GB/s (read + write), bf16 matmul "
          f"{peaks['bf16_matmul_TFLOPs']:.0f} TFLOP/s; shape Hq={args.num_heads} Hkv={args.num_kv_heads} "
          f"D={args.head_dim} bf16 block {args.block_size}; peer = SDPA(enable_gqa) on contiguous K/V; "
          f"{'CUDA-graph replays (device time)' if USE_GRAPHS else 'plain calls'}")
    print(f"{'kind':<8}{'batch':>6}{'ctx':>7}{'splits':>7} {'ours ms':>9} {'1split':>8} {'sdpa ms':>9} "
          f"{'ours':>9} {'%peak':>7} {'sdpa':>9} {'%peak':>7} {'vs sdpa':>7} {'max diff':>9}")
    print("  (decode: GB/s of K+V+q+out vs copy peak; prefill: causal TFLOP/s vs matmul peak)")
    rows = []
    for context in bench_common.parse_int_list(args.decode_contexts):
        for batch in bench_common.parse_int_list(args.decode_batches):
            rows.append(run_case("decode", batch, context, args, peaks, flush))
            torch.cuda.empty_cache()  # the case's tensors died with run_case; the next context needs the memory
            print_row(rows[-1])
    for length in bench_common.parse_int_list(args.prefill_lens):
        rows.append(run_case("prefill", 1, length, args, peaks, flush))
        print_row(rows[-1])
    with open(args.json, "w") as f:
        json.dump({"script": "bench_attention", "env": bench_common.env_info(), "args": vars(args), "peaks": peaks,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
