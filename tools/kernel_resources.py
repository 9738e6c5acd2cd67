"""Registers, stack and spill instructions of the Triton paged-attention kernel as the engine launches it at the
Qwen3-0.6B shape (decode at batch 1 and 8, a prefix-cache hit's 64-token chunk over 4,160 keys), for each variant of
the launch knobs (warps, keys per tile, the prefetching loop), and of the small-M GEMV at every config of its tuned
table; compiled for sm_90 on any machine (no GPU: Triton's compiler and its bundled cuobjdump / nvdisasm). A kernel
that spills keeps part of its state in local memory; this says where, so the next device run knows which variants
to time. Example:
    python tools/kernel_resources.py --json kernel_resources.json
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from graphrunner.attention import decode_prep
from graphrunner.attention import triton_attention as ta

HQ, HKV, DIM, BLOCK_SIZE = 16, 8, 128, 16  # Qwen3-0.6B attention, the engine's default block size
# (name, requests, new tokens each, keys): what the engine launches in L1 / L2 / P1
SHAPES = (("decode b=1 ctx=330", 1, 1, 330), ("decode b=8 ctx=330", 8, 1, 330), ("hit 64 over 4160", 1, 64, 4160))


def launch_constexprs(num_reqs: int, q_len: int, keys: int, tile: int, prefetch: bool,
                      prep: bool = False) -> tuple[dict[str, Any], int]:
    """The constexprs and default warps `_launch` picks for this step (its rules, this module's knobs)."""
    group = HQ // HKV
    tiles = num_reqs * ta.query_tiles(q_len, group)
    splits = ta.choose_num_splits(tiles, HKV, keys)
    rows = ta.DECODE_ROWS if q_len <= 1 else ta.SPLIT_PREFILL_ROWS if splits > 1 else ta.PREFILL_ROWS
    block_m = max(rows, triton.next_power_of_2(group))
    consts = {"GROUP": group, "HEAD_DIM": DIM, "D_PAD": DIM, "BLOCK_SIZE": BLOCK_SIZE, "BLOCK_Q": block_m // group,
              "BLOCK_M": block_m, "TILE": max(tile, BLOCK_SIZE), "NUM_SPLITS": splits, "USE_WINDOW": False,
              "USE_SOFTCAP": False, "FP32_DOT": False, "PDL": True, "FOLD_MERGE": False, "PREFETCH": prefetch,
              "PREP": prep, "HAS_NORM": prep}
    return consts, 8 if block_m >= 128 else 4


def signature(consts: dict[str, Any]) -> dict[str, str]:
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
                "part_ml_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
                "counter_ptr": "*i32", "scale": "fp32", "softcap": "fp32", "qkv_ptr": "*bf16", "q_norm_ptr": "*bf16",
                "k_norm_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64", "eps": "fp32"}
    params = inspect.signature(ta._unified_attention_kernel.fn).parameters
    return {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in params}


def resources(kernel: Any, sig: dict[str, str], consts: dict[str, Any], options: dict[str, int],
              divisible: tuple[str, ...] = ()) -> dict[str, int]:
    """REG / STACK from cuobjdump -res-usage, the local-memory instructions (LDL / STL) and the asynchronous copies
    (LDGSTS: a software-pipelined loop) in the SASS, and the shared memory. Pointers, and the integer arguments named
    in `divisible`, carry the divisible-by-16 hint a real launch's specialisation gives them: without it Triton
    cannot prove the alignment cp.async needs, and compiles a loop that is not pipelined."""
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n in divisible)}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(bindir / "nvdisasm"), cubin], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":") for line in usage.splitlines() if "REG:" in line for tok in line.split())
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
            "spill_instructions": sass.count("LDL") + sass.count("STL"), "async_copies": sass.count("LDGSTS"),
            "shared_bytes": int(compiled.metadata.shared)}


# the GEMV's integer arguments that are multiples of 16 at the 0.6B shapes (N, K, strides, K per split), as a launch
# specialises them
_GEMV_DIVISIBLE = ("N", "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")


def gemv_rows() -> list[dict[str, Any]]:
    """The small-M GEMV at each config of its tuned table (models/gemv_configs.json), at M = 1 and its max_m, with
    the MLP activation prologue where it applies (the down projection, K = 3072 at the 0.6B shape)."""
    from graphrunner.models import gemv

    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "norm_ptr": "*bf16", "out_ptr": "*bf16",
            "part_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32"}
    params = inspect.signature(gemv._gemv_kernel.fn).parameters
    rows = []
    for entry in json.loads(gemv.TUNED_CONFIGS_FILE.read_text()):
        for cfg in entry["configs"]:
            for m, act in itertools.product(sorted({1, cfg["max_m"]}), (False, True) if entry["K"] == 3072 else (False,)):
                consts = {"M_PAD": 16 if cfg["use_dot"] else triton.next_power_of_2(m), "BLOCK_N": cfg["block_n"],
                          "BLOCK_K": cfg["block_k"], "SPLIT": cfg["split_k"] > 1, "HAS_BIAS": False,
                          "USE_DOT": cfg["use_dot"], "NORM": False, "ACT": act,
                          "SWAP_AB": cfg.get("swap_ab", False), "PREFETCH": False, "PDL": True,
                          "PARTIALS": False}
                sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in params}
                row = {"N": entry["N"], "K": entry["K"], "M": m, "act": act, "config": cfg,
                       **resources(gemv._gemv_kernel, sig, consts,
                                   {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}, _GEMV_DIVISIBLE)}
                rows.append(row)
                print(f"gemv N={row['N']:<5} K={row['K']:<5} M={m} act {int(act)} block_n {cfg['block_n']:<3} "
                      f"block_k {cfg['block_k']:<5} dot {int(cfg['use_dot'])}: {row['registers']:3d} registers, "
                      f"{row['stack_bytes']:4d} B stack, {row['spill_instructions']:3d} spill instructions, "
                      f"{row['shared_bytes']:6d} B shared, {row['async_copies']:3d} async copies", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", default="4,8", help="num_warps values (the engine's pick is marked *)")
    ap.add_argument("--tiles", default="32,64", help="keys per iteration (GRAPHRUNNER_ATTN_TILE)")
    ap.add_argument("--json", default="kernel_resources.json")
    args = ap.parse_args()
    rows = []
    for (name, b, q, keys), warps, tile, prefetch, prep in itertools.product(
            SHAPES, [int(w) for w in args.warps.split(",")], [int(t) for t in args.tiles.split(",")], (False, True),
            (False, True)):
        if prep and q > 1:
            continue  # the folded prologue (attention/decode_prep.py) serves decode steps only
        consts, engine_warps = launch_constexprs(b, q, keys, tile, prefetch, prep)
        row = {"shape": name, "warps": warps, "tile": tile, "prefetch": prefetch, "prep": prep,
               "splits": consts["NUM_SPLITS"], "block_m": consts["BLOCK_M"],
               "engine_launch": warps == (ta.ATTN_WARPS or engine_warps) and tile == ta.TILE_N
               and prefetch == ta.PREFETCH_KV and prep == (decode_prep.DECODE_PREP and q <= 1),
               **resources(ta._unified_attention_kernel, signature(consts), consts, {"num_warps": warps})}
        rows.append(row)
        print(f"{name:<20} warps {warps} tile {tile:<3} prefetch {int(prefetch)} prep {int(prep)} "
              f"splits {row['splits']:<2}: "
              f"{row['registers']:3d} registers, {row['stack_bytes']:4d} B stack, {row['spill_instructions']:3d} "
              f"spill instructions{'  *' if row['engine_launch'] else ''}", flush=True)
    gemv = gemv_rows()
    Path(args.json).write_text(json.dumps({"script": "kernel_resources", "triton": triton.__version__,
                                           "rows": rows, "gemv": gemv}, indent=1))
    print(f"wrote {args.json} (* = what the engine launches with the current knobs)")


if __name__ == "__main__":
    main()
