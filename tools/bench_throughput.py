"""Throughput benchmark T1 of BENCHMARKS.md: output tokens/s over a whole offline run of many requests.

256 requests, prompt lengths uniform in [100, 1024] (random.seed(0)), ids uniform in [0, 10000), exactly 512
output tokens each at temperature 0.6, ignoring EOS. Peer: HF continuous batching (`model.generate_batch`) on the
first --peer-requests requests. Example: python tools/bench_throughput.py --model /tmp/qwen3-0.6b-random
T1 with penalties (issue 17: within 10% of T1 without): --penalties both --runs 3 alternates runs without and with
repetition/presence/frequency penalties on every request in one process and prints the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from bench_common import (
    Report,
    Row,
    TritonSpecialisations,
    add_common_args,
    build_ours,
    check_lengths,
    load_hf_model,
    ours_generate,
    parse_int_list,
    random_prompts,
    release,
    reset_compiled_state,
    resolve_device,
    timed,
)
from step_timer import StepTimer, describe

HF_CB, OURS = "hf-generate_batch", "ours"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_json="bench_throughput.json")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--peer-requests", type=int, default=64,
                   help="the HF peer runs on the first K requests only (it takes minutes for all); default %(default)s")
    p.add_argument("--max-num-seqs", type=int, default=256, help="ours")
    p.add_argument("--warmup-requests", type=int, default=4, help="ours: size of the warm-up generate (16 tokens each)")
    p.add_argument("--no-prefix-caching", action="store_true", help="ours: enable_prefix_caching=False")
    p.add_argument("--detokenize", action="store_true", help="ours: detokenize outputs (T1 counts it: BENCHMARKS.md)")
    p.add_argument("--capture-sizes", type=parse_int_list, default=None,
                   help="ours: FULL decode batch sizes, e.g. 1,2,4,8 (compilation_config's cudagraph_capture_sizes)")
    p.add_argument("--runs", type=int, default=1, help="ours: timed runs back to back in one process (median kept)")
    p.add_argument("--both-detok", action="store_true",
                   help="ours: alternate runs with and without detokenization (--runs of each)")
    p.add_argument("--penalties", choices=("off", "on", "both"), default="off",
                   help="ours: every request without penalties (off), with them (on), or alternate runs of both "
                        "(--runs of each; reports with/without); default %(default)s")
    p.add_argument("--repetition-penalty", type=float, default=1.1, help="with --penalties on/both")
    p.add_argument("--presence-penalty", type=float, default=0.2, help="with --penalties on/both")
    p.add_argument("--frequency-penalty", type=float, default=0.2, help="with --penalties on/both")
    return p.parse_args(argv)


def hf_generate_batch(model: Any, prompts: list[list[int]], output_len: int, temperature: float) -> dict[str, Any]:
    """One `generate_batch` call; returns token lists and timings (wall, and first request added -> last done)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=temperature > 0, temperature=temperature,
                              top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=0)  # eos -1: never stops early
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    wall = time.perf_counter() - t0
    outs = list(results.values())
    errors = [o.error for o in outs if getattr(o, "error", None)]
    if errors or len(outs) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(outs)} results for {len(prompts)} requests; errors: {errors[:3]}")
    tokens = [list(o.generated_tokens) for o in outs]
    check_lengths(tokens, output_len, HF_CB)
    # Excludes the manager's own warm-up (CUDA-graph capture) that precedes add_requests, when timestamps exist.
    starts = [getattr(o, "created_time", None) for o in outs]
    ends = [getattr(o, "lifespan", (-1, -1))[1] for o in outs]
    serve = max(ends) - min(starts) if None not in starts and min(ends) > 0 else None
    return {"tokens": tokens, "wall_s": wall, "serve_s": serve}


def run_peer(args: argparse.Namespace, prompts: list[list[int]], device: torch.device, report: Report,
             results: dict[str, Any]) -> None:
    subset = prompts[: args.peer_requests]

    def body() -> None:
        model = load_hf_model(args.model, device, args.dtype)
        r = hf_generate_batch(model, subset, args.output_len, args.temperature)
        n_out = len(subset) * args.output_len
        seconds = r["serve_s"] or r["wall_s"]
        results[HF_CB] = {"requests": len(subset), "output_tokens": n_out, "wall_s": r["wall_s"],
                          "serve_s": r["serve_s"], "tok_s": n_out / seconds, "tok_s_incl_warmup": n_out / r["wall_s"]}
        print(f"  {HF_CB}: {len(subset)} requests, {n_out / seconds:.1f} output tok/s "
              f"({n_out / r['wall_s']:.1f} incl. its warm-up; wall {r['wall_s']:.1f} s)", flush=True)
        del model, r

    report.section(HF_CB, body)
    release()


def compilation_config(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's compilation_config keyword: --compilation-config, with --capture-sizes as its capture sizes."""
    given = args.compilation_config
    cc = {"level": given} if isinstance(given, int) else dict(given or {})
    if args.capture_sizes is not None:
        cc["cudagraph_capture_sizes"] = args.capture_sizes
    return {"compilation_config": cc} if cc else {}


def run_ours(args: argparse.Namespace, prompts: list[list[int]], device: torch.device, report: Report,
             results: dict[str, Any]) -> None:
    def body() -> None:
        specs = TritonSpecialisations()
        llm = build_ours(args.model, device, max_model_len=args.max_prompt + args.output_len,
                         max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         enable_prefix_caching=not args.no_prefix_caching,
                         **compilation_config(args))
        warm = prompts[: args.warmup_requests]
        warm_s = timed(lambda: ours_generate(llm, warm, 16, args.temperature), device)
        detok_modes = [True, False] if args.both_detok else [args.detokenize]
        pen_modes = {"off": [False], "on": [True], "both": [False, True]}[args.penalties]
        modes = [(d, pen) for d in detok_modes for pen in pen_modes]
        penalties = {"repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
                     "frequency_penalty": args.frequency_penalty}
        timer = StepTimer(llm)
        runs: dict[tuple[bool, bool], list[dict[str, Any]]] = {m: [] for m in modes}
        n_out = len(prompts) * args.output_len
        for i in range(max(1, args.runs)):
            for detok, pen in modes:
                llm.reset_prefix_cache()  # every run is T1 from scratch: no prompt is a cache hit
                timer.reset()
                kernels, mark = _triton_cache_entries(), len(specs.seen)
                extra = penalties if pen else {}
                seconds = timed(lambda d=detok, e=extra: ours_generate(llm, prompts, args.output_len, args.temperature,
                                                                      d, **e), device)
                steps = timer.summary()
                steps["new_triton_kernels"] = _triton_cache_entries() - kernels  # compiled during the run
                steps["new_triton_specialisations"] = specs.since(mark)  # first launched during the run
                runs[(detok, pen)].append({"wall_s": seconds, "tok_s": n_out / seconds, "steps": steps})
                print(f"  {OURS} run {i + 1} detokenize={detok} penalties={pen}: {n_out / seconds:.1f} output tok/s "
                      f"(wall {seconds:.2f} s); {describe(steps)}; {steps['new_triton_kernels']} Triton kernels compiled",
                      flush=True)
                for name in steps["new_triton_specialisations"]:
                    print(f"    first launched in this run: {name}", flush=True)
        timer.close()
        main_mode = modes[0]

        def median(mode: tuple[bool, bool]) -> float:
            return statistics.median(r["tok_s"] for r in runs[mode])

        tok_s = median(main_mode)
        results[OURS] = {"requests": len(prompts), "output_tokens": n_out, "warmup_s": warm_s, "tok_s": tok_s,
                         "detokenize": main_mode[0], "penalties": penalties if main_mode[1] else None,
                         "prompt_tokens": sum(map(len, prompts)),
                         "runs": {f"detokenize={d},penalties={pen}": r for (d, pen), r in runs.items()}}
        if args.both_detok:
            results[OURS]["tok_s_no_detok"] = median((False, main_mode[1]))
        if args.penalties == "both":
            with_pen = median((main_mode[0], True))
            results[OURS]["tok_s_penalties"] = with_pen
            results[OURS]["penalties"] = penalties
            print(f"  {OURS}: with penalties {penalties}: median {with_pen:.1f} output tok/s = "
                  f"{with_pen / tok_s:.3f} x without ({tok_s:.1f})", flush=True)
        print(f"  {OURS}: {len(prompts)} requests, median {tok_s:.1f} output tok/s over {len(runs[main_mode])} "
              f"run(s) (detokenize={main_mode[0]}, penalties={main_mode[1]}; warm-up {warm_s:.2f} s)", flush=True)

    report.section(OURS, body)
    reset_compiled_state()


def _triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache: a run that adds some compiled them mid-run (a warm-up effect)."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return len(os.listdir(root)) if os.path.isdir(root) else 0


def fill_rows(args: argparse.Namespace, report: Report, results: dict[str, Any]) -> None:
    ours, peer = results.get(OURS), results.get(HF_CB)
    note = ""
    if peer is not None:
        note = f"peer: first {peer['requests']} of {args.num_requests} requests"
        if peer["serve_s"] is None:
            note += ", incl. its warm-up"
    report.add(Row("T1", "output throughput", "tok/s", True, ours and ours["tok_s"], HF_CB if peer else "",
                   peer and peer["tok_s"], note))


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    device = resolve_device(args.device)
    prompts = random_prompts(args.num_requests, args.min_prompt, args.max_prompt, seed=0)
    report = Report("bench_throughput", vars(args))
    results: dict[str, Any] = {}
    print(f"device {device}; T1: {len(prompts)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
          f"({sum(map(len, prompts))} in all), {args.output_len} output tokens each, T={args.temperature}")
    if not args.no_peer:
        run_peer(args, prompts, device, report, results)
    if not args.no_ours:
        run_ours(args, prompts, device, report, results)
    report.extra["results"] = results
    fill_rows(args, report, results)
    report.print_table()
    report.write_json(args.json)
    return report


if __name__ == "__main__":
    main()
