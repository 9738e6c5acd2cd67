"""Decode-kernel micro-benchmark: the sampler (vocab-split vs row-per-program vs torch) at batch 1/8/256 and the
small-M GEMV vs torch (cuBLAS) at the Qwen3-0.6B linear shapes for M = 1, 2, 4, 8, with achieved GB/s.

On CUDA each timing is a CUDA graph of many back-to-back calls (no Python launch cost in the figure), replayed
--reps times, median per call. GEMV weights rotate over enough copies to overflow L2, as 28 layers do. --sweep
also times a grid of GemvConfigs per shape and prints the best. CPU (interpreter) only with --quick sizes.
Example: python tools/bench_kernels.py --json bench_kernels.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, which puts the repo root on sys.path
import bench_common
import torch
import torch.nn.functional as F
import triton

from graphrunner.kernel_checks import num_sms as _num_sms
from graphrunner.models.gemv import MAX_M, GemvConfig, config_for, default_config, gemv_triton, tuned_configs
from graphrunner.sampling import gumbel_split
from graphrunner.sampling.batch import RequestSampling, SampleEntry, build_sampling_batch
from graphrunner.sampling.gumbel import sample_rowwise_triton
from graphrunner.sampling.gumbel_split import sample_split_triton
from graphrunner.sampling.sampler import run_sampler
from graphrunner.sampling_params import SamplingParams
from graphrunner.state_table import StateTable

# Qwen3-0.6B: hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072, vocab 151936.
QWEN3_06B_SHAPES: dict[str, tuple[int, int]] = {  # name -> (N, K) of W [N, K]
    "qkv 1024->4096": (4096, 1024),
    "o 2048->1024": (1024, 2048),
    "gate_up 1024->6144": (6144, 1024),
    "down 3072->1024": (1024, 3072),
    "lm_head 1024->151936": (151936, 1024),
}


def model_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """The decoder's linear weights [N, K] from a HF config.json (one GPU, no tensor parallelism): fused qkv, o,
    fused gate_up, down and the LM head."""
    path = Path(model_dir) / "config.json"
    try:
        c = json.loads(path.read_text())
        h, heads, inter, vocab = (int(c[key]) for key in ("hidden_size", "num_attention_heads", "intermediate_size",
                                                           "vocab_size"))
        kv = int(c.get("num_key_value_heads") or heads)
        d = int(c.get("head_dim") or h // heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--shapes model:{model_dir}: cannot read the layer shapes from {path}: {exc}") from exc
    return {f"model qkv {h}->{(heads + 2 * kv) * d}": ((heads + 2 * kv) * d, h),
            f"model o {heads * d}->{h}": (h, heads * d), f"model gate_up {h}->{2 * inter}": (2 * inter, h),
            f"model down {inter}->{h}": (h, inter), f"model lm_head {h}->{vocab}": (vocab, h)}


def select_shapes(spec: str) -> dict[str, tuple[int, int]]:
    """--shapes: comma-separated parts, each a part of a QWEN3_06B_SHAPES name, an explicit "NxK" weight (another
    model's layer, e.g. the trained spec target's qkv 2048x1024) or "model:DIR" (that model's layers and LM head,
    model_shapes); empty: every 0.6B shape."""
    parts = [p.strip() for p in spec.split(",") if p.strip()] or [""]
    shapes: dict[str, tuple[int, int]] = {}
    for part in parts:
        m = re.fullmatch(r"(\d+)x(\d+)", part)
        if m:
            shapes[part] = (int(m.group(1)), int(m.group(2)))
            continue
        if part.startswith("model:"):
            shapes.update(model_shapes(part.removeprefix("model:")))
            continue
        found = {name: nk for name, nk in QWEN3_06B_SHAPES.items() if part in name}
        if not found:
            raise SystemExit(f"--shapes: {part!r} is neither NxK nor part of a shape name ({', '.join(QWEN3_06B_SHAPES)})")
        shapes.update(found)
    return shapes


L2_BYTES = 256 << 20  # rotate weights over at least this much memory (H200 L2: 50 MB)


def time_us(calls: list[Callable[[], Any]], device: torch.device, reps: int, per_graph: int = 64) -> float:
    """Median microseconds per call; calls[i % len(calls)] run in turn (e.g. one per weight copy)."""
    for fn in calls:
        fn()  # compile / warm up outside any capture
    n = max(per_graph, len(calls))
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i in range(n):
            calls[i % len(calls)]()
        return (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(n):
            calls[i % len(calls)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def bench_sampler(batch_sizes: list[int], vocab: int, device: torch.device, reps: int) -> list[dict]:
    rows = []
    original = gumbel_split.SPLIT_SAMPLE_ENABLED, gumbel_split.SPLIT_SAMPLE_SERIAL
    for bs, (setting, temp) in itertools.product(batch_sizes, (("greedy", 0.0), ("gumbel", 0.8))):
        g = torch.Generator().manual_seed(bs)
        logits = (torch.randn(bs, vocab, generator=g) * 3).to(device)  # [B, V] float32
        idx = torch.arange(bs, dtype=torch.int32, device=device)
        temperature = torch.full((bs,), temp, device=device)
        seeds = torch.arange(bs, dtype=torch.int64, device=device)
        num_tokens = torch.full((bs,), 100, dtype=torch.int32, device=device)
        args = (logits, idx, temperature, seeds, num_tokens)
        state = StateTable(bs, 8, 1, device, device.type == "cuda")
        params = SamplingParams(max_tokens=1, seed=1, temperature=temp)
        for r in range(bs):
            state.stage_new_row(r, [1, 2, 3], 3, 0, params, r)
        state.apply_staged()
        sbatch = build_sampling_batch([SampleEntry(r, params, RequestSampling(), 0) for r in range(bs)], idx, device)

        def pipeline(split: bool, b: Any = sbatch, x: torch.Tensor = logits, st: StateTable = state) -> None:
            gumbel_split.SPLIT_SAMPLE_ENABLED, gumbel_split.SPLIT_SAMPLE_SERIAL = split, original[1]
            run_sampler(x, b, st, device.type == "cuda")  # x is not edited on this path: no clone needed

        def split_with(serial: bool, a: tuple = args) -> None:
            gumbel_split.SPLIT_SAMPLE_SERIAL = serial
            sample_split_triton(*a)

        timings = {
            "split, one launch": time_us([lambda: split_with(True)], device, reps),
            "split + reduce kernel": time_us([lambda: split_with(False)], device, reps),
            "row-per-program kernel": time_us([lambda a=args: sample_rowwise_triton(*a)], device, reps),
            "run_sampler split (fused NaN check; as configured)": time_us([lambda: pipeline(True)], device, reps),
            "run_sampler row-per-program + isfinite": time_us([lambda: pipeline(False)], device, reps),
        }
        gumbel_split.SPLIT_SAMPLE_ENABLED, gumbel_split.SPLIT_SAMPLE_SERIAL = original
        if setting == "greedy":
            timings["torch argmax"] = time_us([lambda x=logits: x.argmax(-1)], device, reps)
        gbs = {k: bs * vocab * 4 / (us * 1e3) for k, us in timings.items()}
        rows.append({"batch": bs, "vocab": vocab, "setting": setting, "us": timings, "logits_GBps": gbs})
        print(f"sampler b={bs:<4} {setting:<6} " + "  ".join(f"{k}: {us:7.1f} us" for k, us in timings.items()),
              flush=True)
    return rows


def _weights(n: int, k: int, device: torch.device) -> list[torch.Tensor]:
    copies = max(1, -(-L2_BYTES // (n * k * 2))) if device.type == "cuda" else 1
    return [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]


def _sweep_configs(n: int, k: int, sms: int) -> list[GemvConfig]:
    """Row-loop launch shapes worth timing for W [N, K]: 8..128 weights per thread, at least one program per SM."""
    kp = triton.next_power_of_2(k)
    out = []
    for bn, bk, split, warps in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048, 4096),
                                                  (1, 2, 4), (4, 8)):
        per_thread = bn * bk // (32 * warps)
        if bk > kp or split * bk > kp or not 8 <= per_thread <= 128 or triton.cdiv(n, bn) * split < sms:
            continue
        for stages in (1, 3) if kp // (split * bk) >= 2 else (1,):
            out.append(GemvConfig(bn, bk, split, num_warps=warps, num_stages=stages))
    return out


def _sweep_dot_configs(n: int, k: int, sms: int, space: str = "many") -> list[GemvConfig]:
    """Tensor-core launch shapes (x padded to 16 rows) worth timing, in both orientations (x or the weight tile as
    the MMA's A operand). space "many": N tiles of 16-128, K steps of 64-1024, split K up to 8, pipelines of 1-4
    stages, at least one program per two SMs. (Small K steps in deep pipelines keep a program's shared memory small,
    so several programs share an SM and more weight bytes are in flight.) space "few": what "many" leaves out, one
    program per SM or fewer (a quarter of the SMs at least) with 1-4 warps, 3-4 stages of 8 KB of weights or more,
    K split at most in four: fewer, longer programs streaming their weight slice through a deep pipeline, with less
    or no split-K reduction (its tail, an atomic and the last program's sum, costs ~1.7 µs at M = 8 on the H200)."""
    kp = triton.next_power_of_2(k)
    out = []
    few = space == "few"
    for swap, bn, bk, split, warps in itertools.product((False, True), (16, 32, 64, 128), (64, 128, 256, 512, 1024),
                                                        (1, 2, 4) if few else (1, 2, 4, 8), (1, 2, 4) if few else (4, 8)):
        programs = triton.cdiv(n, bn) * split
        if bk > kp or split * bk > kp or (bn + 16) * bk // (32 * warps) > 192 or (bn > 64 and not swap):
            continue
        # ("few" skips what "many" already times: 4 warps with at least one program per two SMs)
        if few and (not sms <= 4 * programs <= 4 * sms or (warps == 4 and 2 * programs >= sms) or bn * bk < 4096):
            continue
        if not few and (2 * programs < sms or (warps == 8 and bn * bk < 16384)):
            continue
        stages_all = (3, 4) if few else (1, 2, 3, 4)
        for stages in stages_all if kp // (split * bk) >= 2 else (1,):
            out.append(GemvConfig(bn, bk, split, num_warps=warps, num_stages=stages, use_dot=True, swap_ab=swap))
    return out


def choose_plan(ms: list[int], cublas: dict[int, float], loop: dict[int, float],
                dot: dict[int, float]) -> tuple[int, int]:
    """(s, d): the row loop serves M <= s, tensor cores s < M <= d, cuBLAS the rest; s and d powers of two (or 0 /
    s: unused), chosen for the least total time over the measured ms. Ties keep fewer kernels."""
    best: tuple[float, int, int, int] | None = None
    for s in (0, 1, 2, 4, 8):
        for d in (s, *(p for p in (2, 4, 8) if p > s)):
            def cost(m: int, s: int = s, d: int = d) -> float:
                table = loop if m <= s else dot if m <= d else cublas
                return table.get(m, float("inf"))
            key = (sum(cost(m) for m in ms), (s > 0) + (d > s), s, d)
            if best is None or key[:2] < best[:2]:
                best = key
    assert best is not None
    return best[2], best[3]


def _top_at_every_m(candidates: list[GemvConfig], at_m: int, keep: int, xs: dict[int, torch.Tensor],
                    weights: list[torch.Tensor], device: torch.device, reps: int) -> list[tuple[GemvConfig, dict]]:
    """Every candidate timed at M = at_m, then the best `keep` of them at every M of xs."""
    timed = sorted(((_gemv_us(xs[at_m], weights, c, device, reps), c) for c in candidates), key=lambda t: t[0])
    return [(c, {m: _gemv_us(x, weights, c, device, reps) for m, x in xs.items()}) for _, c in timed[:keep]]


def _gemv_us(x: torch.Tensor, weights: list[torch.Tensor], cfg: GemvConfig, device: torch.device,
             reps: int) -> float:
    """Median us per call, inf where the config does not compile or launch (a sweep goes on)."""
    try:
        return time_us([lambda w=w: gemv_triton(x, w, None, cfg) for w in weights], device, reps)
    except Exception as exc:  # noqa: BLE001 - one bad launch shape must not end a sweep
        print(f"  skipped {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
        return float("inf")


def write_tuned(path: Path, rows: list[dict]) -> None:
    """Merge the swept rows' best configs into the tuned-table file at path (runs over different shapes add up)."""
    table = {(e["N"], e["K"]): e for e in (json.loads(path.read_text()) if path.exists() else [])}
    for r in rows:
        if "best_configs" in r:
            note = table.get((r["N"], r["K"]), {}).get("note")
            if note:  # a row picked by an engine measurement, not by this loop (docs/DECISIONS.md)
                print(f"replacing ({r['N']}, {r['K']}), whose row said: {note}", flush=True)
            table[(r["N"], r["K"])] = {"N": r["N"], "K": r["K"], "configs": r["best_configs"],  # []: cuBLAS
                                       "gemv_us": r["best_us"], "cublas_us": r["torch_us"]}
    path.write_text(json.dumps(sorted(table.values(), key=lambda e: (e["N"], e["K"])), indent=1))
    print(f"{len(table)} tuned GEMV shapes in {path}", flush=True)


def bench_gemv(shapes: dict[str, tuple[int, int]], ms: list[int], device: torch.device, reps: int,
               sweep: bool, loop_from_table: bool = False, tuned_out: Path | None = None,
               dot_space: str = "many") -> list[dict]:
    """Per shape: cuBLAS and the GEMV (the tuned config serving each M, else the heuristic) at each M; with
    `sweep`, every row-loop candidate at the smallest M and every tensor-core candidate at the largest, the best
    of each at every M, and the plan (which serves which M) with the least total time: `best_configs`, written to
    tuned_out after each shape (a sweep cut short keeps what it finished)."""
    rows = []
    sms = _num_sms(device)
    for name, (n, k) in shapes.items():
        weights = _weights(n, k, device)
        xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in ms}
        row: dict[str, Any] = {"shape": name, "N": n, "K": k, "torch_us": {}, "gemv_us": {}, "config": {}}
        for m, x in xs.items():
            cfg = (config_for(m, n, k) if device.type == "cuda" else None) or default_config(n, k, device)
            row["config"][m] = cfg.__dict__
            nbytes = (n * k + m * k + m * n) * 2
            err = (gemv_triton(x, weights[0], None, cfg).float() - F.linear(x, weights[0]).float()).abs().max().item()
            row["torch_us"][m] = t_us = time_us([lambda w=w, x=x: F.linear(x, w) for w in weights], device, reps)
            row["gemv_us"][m] = g_us = _gemv_us(x, weights, cfg, device, reps)
            print(f"gemv {name:<22} M={m}  torch {t_us:7.1f} us {nbytes / (t_us * 1e3):6.0f} GB/s   "
                  f"gemv {g_us:7.1f} us {nbytes / (g_us * 1e3):6.0f} GB/s   ({t_us / g_us:4.2f}x)  err {err:.2e}",
                  flush=True)
        if sweep:
            tuned_loop = [dataclasses.replace(c, max_m=MAX_M) for c in tuned_configs().get((n, k), ())
                          if not c.use_dot] if loop_from_table else []
            loop_candidates = tuned_loop or [default_config(n, k, device), *_sweep_configs(n, k, sms)]
            loops = _top_at_every_m(loop_candidates, min(ms), 6, xs, weights, device, reps)
            best_loop, loop_us = min(loops, key=lambda t: t[1][min(ms)])
            # with --loop-from-table the table's own tensor-core config competes too (a narrower space can lose)
            tuned_dot = [dataclasses.replace(c, max_m=MAX_M) for c in tuned_configs().get((n, k), ())
                         if c.use_dot] if loop_from_table else []
            dots = _top_at_every_m(tuned_dot + _sweep_dot_configs(n, k, sms, dot_space), max(ms), 4, xs, weights,
                                   device, reps)
            best_dot, dot_us = min(dots, key=lambda t: sum(t[1].values())) if dots else (None, {})
            s, d = choose_plan(ms, row["torch_us"], loop_us, dot_us)
            configs = ([dataclasses.replace(best_loop, max_m=s)] if s else []) + (
                [dataclasses.replace(best_dot, max_m=d)] if d > s and best_dot is not None else [])
            row["best_configs"] = [c.__dict__ for c in configs]
            row["best_us"] = {m: (loop_us if m <= s else dot_us if m <= d else row["torch_us"])[m] for m in ms}
            for label, (c, us) in (("row loop", (best_loop, loop_us)), ("tensor cores", (best_dot, dot_us))):
                print(f"  best {label}: {c} " + " ".join(f"M={m}: {v:.1f}" for m, v in us.items()), flush=True)
            print(f"  plan: row loop M <= {s}, tensor cores up to {d}; " + " ".join(
                f"M={m}: {row['best_us'][m]:.1f} vs cuBLAS {row['torch_us'][m]:.1f} us" for m in ms), flush=True)
        rows.append(row)
        if sweep and tuned_out is not None:
            write_tuned(tuned_out, [row])
        del weights
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,256", help="sampler batch sizes")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--ms", default="1,2,4,8", help="GEMV token counts")
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing (median)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of GemvConfigs per shape and M")
    ap.add_argument("--loop-from-table", action="store_true",
                    help="with --sweep: the row loop of a shape already in the tuned table is its config there (only "
                    "the tensor-core configs are swept for it)")
    ap.add_argument("--dot-space", choices=("many", "few"), default="many",
                    help="with --sweep: the tensor-core launch shapes timed (few: one program per SM or fewer, "
                    "which many leaves out)")
    ap.add_argument("--shapes", default="", help="comma-separated name parts, NxK weights or model:DIR (a model's "
                    "layers and LM head): only those GEMV shapes (e.g. qkv,o 2048 or 2048x1024 or model:/path/to/model)")
    ap.add_argument("--tuned-out", default=None,
                    help="with --sweep: write the best configs here (commit as graphrunner/models/gemv_configs.json)")
    ap.add_argument("--only", choices=("sampler", "gemv"), default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run of the script)")
    ap.add_argument("--json", default="bench_kernels.json")
    args = ap.parse_args()
    device = bench_common.resolve_device(args.device)
    shapes = select_shapes(args.shapes)
    batch_sizes, vocab = bench_common.parse_int_list(args.batch_sizes), args.vocab
    if args.quick:
        shapes, batch_sizes, vocab = {"tiny 64->48": (48, 64)}, [1, 3], 3000
    result: dict[str, Any] = {"script": "bench_kernels", "env": bench_common.env_info(), "args": vars(args),
                              "tuned_configs_loaded": len(tuned_configs()) if device.type == "cuda" else 0}
    if args.only in (None, "sampler"):
        result["sampler"] = bench_sampler(batch_sizes, vocab, device, args.reps)
    if args.only in (None, "gemv"):
        result["gemv"] = bench_gemv(shapes, bench_common.parse_int_list(args.ms), device, args.reps, args.sweep,
                                    args.loop_from_table, Path(args.tuned_out) if args.tuned_out else None,
                                    args.dot_space)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
