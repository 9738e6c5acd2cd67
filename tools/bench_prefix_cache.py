"""Prefix-cache benchmark: TTFT of a long shared prefix + a short suffix, when the prefix is a cache hit
and when it is a miss (the cache reset before each request), on our engine in one process.

Default: a 4,096-token prefix and 64-token suffixes (BENCHMARKS.md's shape), ids uniform in [0, 10000),
one output token per request, medians over --repeats. Example:
python tools/bench_prefix_cache.py --model /tmp/q06 --json $OUT/bench_prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from bench_common import DEFAULT_MODEL, PROMPT_VOCAB, build_ours, env_info, resolve_device, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--json", default="bench_prefix_cache.json")
    ap.add_argument("--profile", action="store_true",
                    help="after timing: one hit and one miss under torch.profiler (kernel table) and cProfile (host)")
    ap.add_argument("--phases", action="store_true",
                    help="after timing: host wall time per engine phase of --repeats hits and misses (phase_timer)")
    args = ap.parse_args()
    device = resolve_device(args.device)
    from graphrunner import SamplingParams

    rng = random.Random(0)
    prefix = [rng.randrange(PROMPT_VOCAB) for _ in range(args.prefix_len)]
    suffixes = [[rng.randrange(PROMPT_VOCAB) for _ in range(args.suffix_len)] for _ in range(5 * args.repeats + 4)]
    llm = build_ours(args.model, device, max_model_len=args.prefix_len + args.suffix_len + 8, max_num_seqs=8,
                     enforce_eager=False, gpu_memory_utilization=args.gpu_memory_utilization)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    cached: list[int] = []

    def run(suffix: list[int]) -> None:
        out = llm.generate([{"prompt_token_ids": prefix + suffix}], one, use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)

    for s in suffixes[:4]:  # warm-up: compile variants, both paths
        llm.reset_prefix_cache()
        run(s)
        run(s[::-1])
    def timed_loop(first_hit: int) -> tuple[list[float], list[float]]:
        """--repeats (reset, miss, hit) pairs; hits take suffixes[first_hit:], which no earlier call used."""
        miss, hit = [], []
        for i in range(args.repeats):
            llm.reset_prefix_cache()
            cold, warm = suffixes[4 + i], suffixes[first_hit + i]
            miss.append(timed(lambda s=cold: run(s), device) * 1e3)
            assert cached[-1] == 0
            hit.append(timed(lambda s=warm: run(s), device) * 1e3)
            assert cached[-1] >= args.prefix_len // 16 * 16 - 16
        return miss, hit

    miss, hit = timed_loop(4 + args.repeats)
    result: dict[str, Any] = {
        "ttft_miss_ms": statistics.median(miss), "ttft_hit_ms": statistics.median(hit),
        "speedup": statistics.median(miss) / statistics.median(hit), "hit_cached_tokens": cached[-1],
        "miss_ms": miss, "hit_ms": hit, "args": vars(args), "env": env_info()}
    print(f"TTFT, {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffix: miss "
          f"{result['ttft_miss_ms']:.2f} ms, hit {result['ttft_hit_ms']:.2f} ms ({result['speedup']:.1f}x; "
          f"{cached[-1]} tokens from cache)")
    if args.phases:
        result["phases_ms"] = phase_table(llm, run, suffixes, args.repeats, device)
        # the timed loop once more, later in the process: does it still read slower than the phase table's calls?
        again_miss, again_hit = timed_loop(4 + 4 * args.repeats)
        result["again_miss_ms"], result["again_hit_ms"] = again_miss, again_hit
        print(f"timed loop again, after the phase table: miss {statistics.median(again_miss):.2f} ms, hit "
              f"{statistics.median(again_hit):.2f} ms ({statistics.median(again_miss) / statistics.median(again_hit):.1f}x)",
              flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    if args.profile:
        def miss_once() -> None:
            llm.reset_prefix_cache()
            run(suffixes[4])

        profile_one("hit", lambda: run(suffixes[4]), device)
        profile_one("miss", miss_once, device)


def phase_table(llm: Any, run: Any, suffixes: list[list[int]], repeats: int, device: Any) -> dict[str, Any]:
    """Median host time per engine phase (tools/phase_timer.py) of `repeats` misses and hits taken as the timed loop
    takes them (reset, miss, hit), then of `repeats` hits in a row and `repeats` misses in a row."""
    from phase_timer import PhaseTimer

    timer = PhaseTimer(llm)
    out: dict[str, Any] = {}
    # hits take suffixes no earlier call used (a used one would hit its own blocks too)
    fresh = iter(suffixes[4 + 2 * repeats:])

    def miss(i: int) -> None:
        llm.reset_prefix_cache()
        timer.end_call(timed(lambda s=suffixes[4 + i]: run(s), device))

    def hit(i: int) -> None:
        suffix = next(fresh)
        timer.end_call(timed(lambda: run(suffix), device))

    try:
        tables: dict[str, list[dict[str, float]]] = {"miss, alternating": [], "hit, alternating": []}
        for i in range(repeats):
            for name, call in (("miss, alternating", miss), ("hit, alternating", hit)):
                timer.reset()
                call(i)
                tables[name].append(timer.medians_ms())
        for name, rows in tables.items():
            out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for name, call in (("hit, in a row", hit), ("miss, in a row", miss)):
            timer.reset()
            for i in range(repeats):
                call(i)
            out[name] = timer.medians_ms()
        names = list(out)
        print(f"--- host phases, median ms per call ({repeats} calls each)", flush=True)
        print(f"  {'phase':<24}" + "".join(f"{n:>19}" for n in names))
        for k in out[names[0]]:
            print(f"  {k:<24}" + "".join(f"{out[n][k]:19.3f}" for n in names), flush=True)
    finally:
        timer.close()
    return out


def profile_one(name: str, fn: Any, device: Any) -> None:
    """Kernel table (device time per kernel) and the host's cumulative top functions for one call of fn."""
    import cProfile
    import pstats

    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        timed(fn, device)
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"--- {name}: torch.profiler, by {sort}")
    print(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
    pr = cProfile.Profile()
    pr.enable()
    ms = timed(fn, device) * 1e3
    pr.disable()
    print(f"--- {name}: cProfile of one call ({ms:.2f} ms)")
    pstats.Stats(pr).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
