"""The host side of a step, alone: the engine's scheduling, output processing and detokenization at T1's shape,
with the runner replaced by one that returns random tokens at once (no model, no device).

What it prints is the host's cost per step, the figure that must stay below the device's ~8-11 ms per T1 step
on the H200 (BENCHMARKS.md) for a run to stay device-bound; it runs the same on a laptop's CPU, so host-path
changes can be measured without a GPU. Example (a bench model with a tokenizer, any size):
    python tools/make_bench_model.py --out /tmp/tinyb --layers 1 --hidden 64 --intermediate 128 --heads 4 \\
        --kv-heads 2 --head-dim 16 --tokenizer
    python tools/bench_host_path.py --model /tmp/tinyb --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from typing import Any

import torch
from bench_common import random_prompts

from graphrunner import LLM, SamplingParams
from graphrunner.async_output import AsyncStepOutput, StepOutput


def fake_execute(vocab: int, seed: int = 0) -> Any:
    gen = torch.Generator().manual_seed(seed)

    def execute(sched: Any) -> AsyncStepOutput:
        b = len(sched.scheduled)
        sampled = torch.randint(0, vocab, (b,), dtype=torch.int32, generator=gen)  # [B] int32
        return AsyncStepOutput(StepOutput(sampled, torch.zeros(b, dtype=torch.bool)), None)

    return execute


def run(llm: LLM, prompts: list[list[int]], output_len: int, detokenize: bool) -> dict[str, float]:
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True, detokenize=detokenize)
    engine = llm.engine
    steps = 0
    original = engine.step

    def counted() -> Any:
        nonlocal steps
        steps += 1
        return original()

    engine.step = counted
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    engine.step = original
    return {"detokenize": detokenize, "steps": steps, "wall_s": wall, "host_ms_per_step": wall / steps * 1e3,
            "us_per_token": wall / (len(prompts) * output_len) * 1e6}


def run_serve(llm: LLM, prompts: list[list[int]], output_len: int, profile: bool) -> dict[str, float]:
    """The engine-core process's side of a step at T1's shape: EngineCore steps with delta reports for every
    request (as the server asks: token-id deltas, RequestOutputs for first and last reports), each step's messages
    encoded and pickled as the sender thread does."""
    import pickle

    from graphrunner.engine_core import AddRequest, EngineCore
    from graphrunner.engine_core_process import encode_outputs

    wire_bytes = 0

    def emit(outputs: list[Any]) -> None:
        nonlocal wire_bytes
        wire_bytes += len(pickle.dumps(("out", None, encode_outputs(outputs)), protocol=pickle.HIGHEST_PROTOCOL))

    def emit_ids(deltas: Any) -> None:
        nonlocal wire_bytes
        wire_bytes += len(pickle.dumps(("ids", None, (deltas.request_ids, deltas.token_ids)),
                                       protocol=pickle.HIGHEST_PROTOCOL))

    core = EngineCore(llm.engine, None, emit, emit_ids)
    params = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add(AddRequest({"prompt_token_ids": p}, params, f"serve-{i}"))
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    while core.has_work():
        core.step()
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    stats = core.loop_stats
    print(f"serve shape (engine-core side): {stats.steps} steps, host {wall / stats.steps * 1e3:.2f} ms/step "
          f"(engine.step {stats.step_s / stats.steps * 1e3:.2f}, encode + pickle {stats.deliver_s / stats.steps * 1e3:.2f}"
          f"), {wire_bytes / stats.steps / 1e3:.1f} kB/step on the pipe", flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {"serve_host_ms_per_step": wall / stats.steps * 1e3, "serve_step_ms": stats.step_s / stats.steps * 1e3,
            "serve_deliver_ms": stats.deliver_s / stats.steps * 1e3}


def run_p1(model: str, prefix_len: int, suffix_len: int, repeats: int) -> dict[str, float]:
    """P1's shape without a device: the host time of one LLM.generate of a cached prefix + a new suffix (one output
    token), i.e. the host part of a prefix-cache hit's TTFT (intake, keys, admission, scheduling, outputs)."""
    import random
    import statistics

    llm = LLM(model=model, device="cpu", max_num_seqs=8, max_model_len=prefix_len + suffix_len + 8,
              enable_prefix_caching=True, enforce_eager=True)
    llm.engine.runner.execute = fake_execute(llm.engine.config.model.vocab_size)
    rng = random.Random(0)
    prefix = [rng.randrange(10000) for _ in range(prefix_len)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for i in range(repeats + 1):
        suffix = [rng.randrange(10000) for _ in range(suffix_len)]
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prefix + suffix}], one, use_tqdm=False)[0]
        times.append((time.perf_counter() - t0) * 1e3)
        assert i == 0 or out.num_cached_tokens >= prefix_len - 16, "the prefix should be a cache hit"
    ms = statistics.median(times[1:])
    print(f"P1 host path: {prefix_len}-token cached prefix + {suffix_len}-token suffix: {ms:.3f} ms per request "
          f"(median of {repeats})", flush=True)
    return {"p1_host_ms": ms}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF-format dir with a tokenizer (the weights are never run)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--profile", action="store_true", help="cProfile one detokenizing run (top 30 by own time)")
    p.add_argument("--p1", action="store_true", help="instead: the host time of a prefix-cache hit (P1's shape)")
    p.add_argument("--serve", action="store_true",
                   help="instead: the engine-core process's host time per step at T1's shape (delta outputs, "
                        "encoded and pickled for the pipe)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.p1:
        result = run_p1(args.model, 4096, 64, 20)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    prompts = random_prompts(args.num_requests, 100, 1024, seed=0)
    llm = LLM(model=args.model, device="cpu", max_num_seqs=args.num_requests, max_model_len=1024 + args.output_len,
              max_num_batched_tokens=8192, enable_prefix_caching=False, enforce_eager=True)
    llm.engine.runner.execute = fake_execute(llm.engine.config.model.vocab_size)
    if args.serve:
        run_serve(llm, prompts[:8], 4, False)  # warm-up
        result = run_serve(llm, prompts, args.output_len, args.profile)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    results = []
    for detok in (False, True):
        run(llm, prompts[:8], 4, detok)  # warm-up
        r = run(llm, prompts, args.output_len, detok)
        results.append(r)
        print(f"detokenize={detok}: {r['steps']} steps, host {r['host_ms_per_step']:.2f} ms/step "
              f"({r['us_per_token']:.1f} µs per output token)", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(llm, prompts, args.output_len, True)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
