"""Per-step time breakdown of decode at batch --batch (L1: 1): host, prepare, forward, sample, update, the
FULL graph replay that runs prepare..update as one launch, and a per-kernel device-time table.

Host = wall time of engine.step() minus the time it blocks on the previous step's output. The device
parts are each timed alone (median over --iters) on the live decode batch, with the state table
restored after the parts that write it. The kernel table profiles --profile-steps engine steps with
torch.profiler (CUDA activity; kernels inside CUDA graph replays are reported by CUPTI) and groups them
as issue 17's table (kernel_table.py). Example: python tools/bench_step_breakdown.py --model /tmp/q06

With --speculative-method (ngram, eagle, draft_model; --num-speculative-tokens k, --draft-model DIR) the steps are
verify steps of 1 + k tokens per request and the kernel table is per step, proposer included: where a verify
step's time goes next to a plain decode step's (issue 16); with --disable-by-batch-size at or below --batch they are
a speculative engine's plain decode steps (what speculation switched off costs). The timed device parts are plain-decode only and are
skipped then.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, which puts the repo root on sys.path
import bench_common
import kernel_table
import torch

from graphrunner import LLM, SamplingParams
from graphrunner.async_output import AsyncStepOutput
from graphrunner.pdl import use_pdl
from graphrunner.sampling import gumbel_split
from graphrunner.sampling.sampler import run_sampler
from graphrunner.state_kernels import post_update
from graphrunner.step_plan import StepMode, StepPlan


def process_facts() -> dict[str, Any]:
    """Threads (Python and native), the collector's counts and frozen objects, torch's intra-op threads and the CPUs
    this process may run on: the suspects when the EAGLE engine's host steps ran ~1.7x slower than the others'
    (eighteenth session). The nineteenth found the machine's own speed drifting instead: see interpreter_probe."""
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1
    return {"python_threads": sorted(t.name for t in threading.enumerate()), "native_threads": tasks,
            "gc_counts": gc.get_count(), "gc_tracked": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count(),
            "torch_threads": torch.get_num_threads(), "cpus": cpus, **interpreter_state()}


def _cpu_ticks(stat_glob: str) -> dict[str, int]:
    """name -> utime + stime (clock ticks) of each /proc stat file matching the glob (threads or processes)."""
    import glob

    out: dict[str, int] = {}
    for path in glob.glob(stat_glob):
        try:
            text = Path(path).read_text()
        except OSError:  # it ended meanwhile
            continue
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        out[f"{path.split('/')[-2]}:{comm}"] = int(rest[11]) + int(rest[12])
    return out


def busy_while_idle(seconds: float = 1.0) -> dict[str, Any]:
    """Who burns CPU while this process's main thread sleeps: its own threads and every process on the machine
    using more than 5% of a CPU over `seconds` (a spinning thread or a busy compile worker shares the cores the
    host step runs on), and the load average."""
    if not os.path.isdir("/proc/self/task"):
        return {}
    hz = os.sysconf("SC_CLK_TCK")
    threads, procs = _cpu_ticks("/proc/self/task/*/stat"), _cpu_ticks("/proc/[0-9]*/stat")
    time.sleep(seconds)
    threads2, procs2 = _cpu_ticks("/proc/self/task/*/stat"), _cpu_ticks("/proc/[0-9]*/stat")

    def busy(a: dict[str, int], b: dict[str, int]) -> dict[str, float]:
        pct = {k: 100.0 * (v - a.get(k, v)) / hz / seconds for k, v in b.items()}
        return {k: round(v) for k, v in sorted(pct.items(), key=lambda kv: -kv[1]) if v > 5}

    return {"threads_pct_cpu": busy(threads, threads2), "processes_pct_cpu": busy(procs, procs2),
            "loadavg": os.getloadavg()}


def interpreter_state() -> dict[str, Any]:
    """Hooks that slow every frame or every torch op: a trace/profile function, Dynamo's eval-frame callback,
    torch function/dispatch modes, grad and inference mode. Read inside a step (see host_ms) as well as outside."""
    eval_frame = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return {"trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
            "eval_frame": repr(eval_frame()) if eval_frame is not None else "unknown",
            "function_modes": torch._C._len_torch_function_stack(), "dispatch_modes": torch._C._len_torch_dispatch_stack(),
            "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled()}


def interpreter_probe(device: torch.device) -> dict[str, float]:
    """Nanoseconds per iteration of four loops: pure bytecode, a Python call, a CPU torch op, a device torch op.
    Which of them slowed down tells a slower CPU or a contended GIL (all) from a frame hook (calls) or a torch
    mode / dispatch change (ops)."""
    def f(i: int) -> int:
        return i

    def per(fn: Any, n: int) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            fn(n)
            best = min(best, (time.perf_counter() - t0) / n * 1e9)
        return round(best, 1)

    def loop(n: int) -> None:
        x = 0
        for i in range(n):
            x += i

    def calls(n: int) -> None:
        for i in range(n):
            f(i)

    cpu, dev = torch.zeros(8), torch.zeros(8, device=device)

    def ops(t: torch.Tensor) -> Any:
        def run(n: int) -> None:
            for _ in range(n):
                t.add_(1)
        return run

    out = {"loop_ns": per(loop, 200_000), "call_ns": per(calls, 100_000), "cpu_op_ns": per(ops(cpu), 5_000)}
    out["device_op_ns"] = per(ops(dev), 2_000)
    bench_common.synchronize(device)
    return out


@contextmanager
def collections_during() -> Iterator[dict[int, list[float]]]:
    """Garbage collections inside the block, per generation: [count, seconds]."""
    out: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            entry = out[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield out
    finally:
        gc.callbacks.remove(callback)


def host_ms(llm: LLM, steps: int, inside: dict[str, Any] | None = None) -> list[float]:
    """Host milliseconds of each engine.step(): its wall time minus the wait for the previous step's output.
    `inside` receives interpreter_state() as read in the first step's wait for its output."""
    blocked: list[float] = []
    inside = {} if inside is None else inside
    original = AsyncStepOutput.result

    def timed_result(self: AsyncStepOutput) -> dict[str, torch.Tensor]:
        if not inside:
            inside.update(interpreter_state())
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            blocked.append(time.perf_counter() - t0)

    AsyncStepOutput.result = timed_result  # type: ignore[method-assign]
    out = []
    try:
        for _ in range(steps):
            n = len(blocked)
            t0 = time.perf_counter()
            llm.engine.step()
            out.append((time.perf_counter() - t0 - sum(blocked[n:])) * 1e3)
    finally:
        AsyncStepOutput.result = original  # type: ignore[method-assign]
    return out


@torch.inference_mode()  # as the engine runs: with grad mode on, Dynamo compiles a variant that has no graphs
def device_parts(llm: LLM, iters: int) -> dict[str, float]:
    engine, device = llm.engine, llm.engine.config.device
    runner, state = engine.runner, engine.runner.state
    bench_common.synchronize(device)
    sched = engine._pending[0]  # the decode step in flight: restaging it writes nothing new
    batch = runner._stage(sched)
    saved = [t.clone() for t in (state.token_ids, state.num_computed, state.num_tokens)]

    def restore() -> None:
        for dst, src in zip((state.token_ids, state.num_computed, state.num_tokens), saved):
            dst.copy_(src)

    def timed(fn: Any) -> float:
        return bench_common.median_ms(fn, device, iters, before=restore)

    inputs = runner._prepare(batch)
    eager = dataclasses.replace(batch, plan=StepPlan(StepMode.EAGER, batch.num_reqs, batch.shape.num_tokens))
    parts = {"prepare": timed(lambda: runner._prepare(batch)), "forward (no graph)":
             timed(lambda: runner._forward(eager, inputs))}
    if runner.graphs is not None and runner.graphs.token_sizes:
        piecewise = runner.graphs.plan(batch.num_reqs, batch.shape.num_tokens, max(batch.shape.seq_lens), False)
        parts["forward (piecewise graphs)"] = timed(
            lambda: runner._forward(dataclasses.replace(batch, plan=piecewise), inputs))
    hidden = runner._forward(eager, inputs)
    logits = runner.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
    parts["logits"] = timed(lambda: runner.model.compute_logits(hidden.index_select(0, inputs.logits_indices)))
    parts["sample"] = timed(lambda: run_sampler(logits.clone(), batch.sampling, state, runner.use_triton))
    sampled = run_sampler(logits.clone(), batch.sampling, state, runner.use_triton).sampled
    parts["update"] = timed(lambda: post_update(batch.idx_mapping, batch.num_scheduled, sampled, state.token_ids,
                                                state.num_computed, state.num_tokens, runner.use_triton))
    if batch.plan.mode is StepMode.FULL and runner.graphs is not None:
        parts["FULL replay (prepare..update)"] = timed(lambda: runner.graphs.replay_full(batch.plan))
    restore()
    return parts


def kernel_profile(llm: LLM, steps: int, tokens_per_step: int, trace: str) -> dict[str, Any]:
    """Profile `steps` engine steps (steady decode), save the chrome trace to `trace` and group its device
    kernels; see kernel_table.py."""
    from torch.profiler import ProfilerActivity, profile

    device = llm.engine.config.device
    bench_common.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        bench_common.synchronize(device)
    prof.export_chrome_trace(trace)
    events = kernel_table.events_from_chrome_trace(trace)
    if not events:
        print("  (no device kernels recorded: no CUDA, or this torch/CUPTI does not trace CUDA graph replays; "
              "try --enforce-eager to see the kernels without graphs)")
    summary = kernel_table.summarize(kernel_table.kernel_rows(events), steps, tokens_per_step)
    summary["critical_path"] = kernel_table.critical_path(events, steps)
    return summary


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.speculative_method is None:
        return None
    if args.num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens must be >= 1")
    spec: dict[str, Any] = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative_method != "ngram":
        if args.draft_model is None:
            raise ValueError(f"--speculative-method {args.speculative_method} needs --draft-model DIR")
        spec["model"] = args.draft_model
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    return spec


def _max_positions(model: str) -> int | None:
    """The model's max_position_embeddings from its config.json, None where it does not say."""
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=bench_common.DEFAULT_MODEL)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (L1: 1, L2: 8)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed on the host")
    ap.add_argument("--profile-steps", type=int, default=200, help="decode steps in the kernel table (0: none)")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per device part (median)")
    ap.add_argument("--trace", default="bench_step_breakdown_trace.json", help="chrome trace of the profiled steps")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default="bench_step_breakdown.json")
    ap.add_argument("--speculative-method", choices=("ngram", "eagle", "draft_model"), default=None)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculation off at this batch: the steps are plain decodes of a speculative engine")
    ap.add_argument("--draft-model", default=None, help="the draft's (eagle: the head's) directory")
    ap.add_argument("--cprofile", default=None, help="also profile --steps host steps with cProfile into this file")
    args = ap.parse_args()
    device = bench_common.resolve_device(args.device)
    if args.batch < 1 or args.steps < 1 or args.profile_steps < 0:
        raise ValueError("--batch and --steps must be >= 1, --profile-steps >= 0")
    spec = speculative_config(args)
    # the same loops before any engine exists: the process's baseline; and who else is busy then
    probe_before, busy_before = interpreter_probe(device), busy_while_idle()
    k = 0 if spec is None else args.num_speculative_tokens
    decode_steps = args.steps * (2 if args.cprofile else 1) + args.profile_steps + 24  # --cprofile times them twice
    max_len = args.prompt_len + (1 + k) * decode_steps + 32
    limit = _max_positions(args.model)
    if limit is not None and max_len > limit:  # (a speculative step writes 1 + k positions)
        fit = (limit - args.prompt_len - 32) // (1 + k) - 24
        raise SystemExit(f"--prompt-len {args.prompt_len} and {decode_steps - 24} decode steps of {1 + k} positions "
                         f"need max_model_len {max_len}, over the model's {limit}: lower --steps and --profile-steps "
                         f"(together at most {fit}{', --steps counted twice with --cprofile' if args.cprofile else ''})")
    llm = LLM(model=args.model, device=str(device), max_model_len=max_len,
              max_num_seqs=max(8, args.batch), enforce_eager=args.enforce_eager, speculative_config=spec)
    vocab = min(bench_common.PROMPT_VOCAB, llm.engine.config.model.vocab_size)
    prompts = bench_common.random_prompts(args.batch, args.prompt_len, args.prompt_len, vocab=vocab)
    if spec is not None:  # a passage, then its first half again: prompt lookup finds drafts from the first step
        half = args.prompt_len // 2
        prompts = [p[:args.prompt_len - half] + p[:half] for p in prompts]
    for prompt in prompts:
        llm.engine.add_request({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=(1 + k) * decode_steps, ignore_eos=True, detokenize=False))
    for _ in range(4 + args.batch // 8):  # prefill, then into steady decode
        llm.engine.step()
    if args.cprofile:  # where the host's time goes: the timed steps under cProfile (slower), top functions by own time
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(host_ms, llm, args.steps)
        with open(args.cprofile, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
    process = process_facts()  # what else the process holds while it steps (threads, the collector, CPU set)
    process["probe_before_engine"], process["probe_after_warmup"] = probe_before, interpreter_probe(device)
    process["busy_before_engine"], process["busy_after_warmup"] = busy_before, busy_while_idle()
    process["probe_after_idle"] = interpreter_probe(device)  # after the second of sleep: a warm-up effect fades
    inside: dict[str, Any] = {}
    with collections_during() as gc_during:
        host = host_ms(llm, args.steps, inside)
    process["gc_during_timed_steps"] = gc_during  # generation -> [collections, seconds]
    process["inside_step"] = inside
    # per token at plain decode; per step with speculation (a step emits 1 to 1 + k tokens per request)
    per = args.batch if spec is None else 1
    table = kernel_profile(llm, args.profile_steps, per, args.trace) if args.profile_steps else None
    parts = device_parts(llm, args.iters) if spec is None else {}
    pdl_on = use_pdl(llm.engine.config.device)
    switches = {"GRAPHRUNNER_SPLIT_SAMPLE": int(gumbel_split.SPLIT_SAMPLE_ENABLED), "GRAPHRUNNER_PDL": int(pdl_on)}
    print(f"switches: {switches}")
    result = {"host_ms_median": statistics.median(host), "device_ms": parts, "kernels": table, "args": vars(args),
              "switches": switches, "env": bench_common.env_info(), "process": process}
    print(f"process: {process}")
    mode = "CUDA graphs" if llm.engine.runner.graphs is not None else "no graphs"
    what = "decode steps" if spec is None else f"verify steps ({spec['method']}, k = {k}; figures per step)"
    if spec is not None:
        result["spec_decode_counts"] = llm.engine.stats.spec_decode_counts
        result["mean_acceptance_length"] = llm.engine.stats.mean_acceptance_length
        print(f"mean acceptance length {result['mean_acceptance_length']}")
    if table is not None:
        print(f"Kernel table: {args.profile_steps} {what} at batch {args.batch} on {device} ({mode}):")
        print(kernel_table.format_table(table))
        if pdl_on:  # docs/BENCHMARKS.md, fourteenth session
            print("  (PDL is on: a kernel starts before its predecessor ends and waits inside it, so these times overlap "
                  "and their sum overstates the device time; GRAPHRUNNER_PDL=0 gives exclusive times, the FULL replay "
                  "below the real step)")
        print(kernel_table.format_critical_path(table["critical_path"]))
    print(f"Step breakdown at batch {args.batch} on {device} ({mode}):")
    print(f"  host (schedule, stage, launch, read previous)  {result['host_ms_median']:8.3f} ms")
    for name, ms in parts.items():
        print(f"  device: {name:<38} {ms:8.3f} ms")
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
