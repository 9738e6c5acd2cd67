"""Latency benchmarks L1 (batch 1: TTFT, TPOT) and L2 (TPOT at several batch sizes) of BENCHMARKS.md.

TTFT = time of generate(max_tokens=1); TPOT = (time(max_tokens=N) - time(max_tokens=1)) / (N - 1), medians over
--repeats after a warm-up, for our engine and, in the same process, HF eager `generate` (dynamic cache) and HF
static cache + torch.compile. Example: python tools/bench_latency.py --model /tmp/qwen3-0.6b-random
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from bench_common import (
    Report,
    Row,
    add_common_args,
    build_ours,
    load_hf_model,
    measure_ttft_tpot,
    ours_generate,
    parse_int_list,
    random_prompts,
    reset_compiled_state,
    resolve_device,
)

HF_EAGER, HF_STATIC, OURS = "hf-eager", "hf-static+compile", "ours"


@dataclass(frozen=True)
class Case:
    workload: str  # "L1" or "L2"
    batch: int
    prompt_len: int
    output_len: int

    @property
    def key(self) -> str:
        return f"{self.workload} b={self.batch}"

    def prompts(self) -> list[list[int]]:
        return random_prompts(self.batch, self.prompt_len, self.prompt_len, seed=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_json="bench_latency.json")
    p.add_argument("--workloads", default="L1,L2", help="comma list of L1, L2")
    p.add_argument("--batch-sizes", default="1,8,32,128", help="L2 batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="tokens per request (default: L1 256, L2 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats for ours (median)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="our engine's max_model_len (default: the longest prompt + output). FULL decode graphs take "
                        "the KV split count of this length, so a model's own context (Qwen3-0.6B: 40960) shows "
                        "what a default deployment's step costs")
    p.add_argument("--peer-repeats", type=int, default=1, help="timed repeats for the HF peers (they are slow)")
    p.add_argument("--peer-output-len", type=int, default=64,
                   help="N for the HF peers' TPOT (per-token cost barely depends on N at these lengths; saves GPU "
                        "time); 0 = same N as ours; default %(default)s")
    p.add_argument("--hf-static", choices=("auto", "on", "off"), default="auto",
                   help="HF static cache + torch.compile peer; auto = on when CUDA (compiles only on CUDA)")
    p.add_argument("--hf-static-batch-sizes", default="1",
                   help="batch sizes at which the static peer runs (each new batch size recompiles)")
    return p.parse_args(argv)


def build_cases(args: argparse.Namespace) -> list[Case]:
    workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - {"L1", "L2"}
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; this script runs L1 and L2")
    cases = []
    if "L1" in workloads:
        cases.append(Case("L1", 1, args.prompt_len, args.output_len or 256))
    if "L2" in workloads:
        cases += [Case("L2", b, args.prompt_len, args.output_len or 128) for b in parse_int_list(args.batch_sizes)]
    return cases


def hf_run_fn(model: Any, prompts: list[list[int]], static: bool) -> Callable[[int], None]:
    """run(n): HF `generate` of exactly n greedy tokens for the batch (equal-length prompts: no padding)."""
    input_ids = torch.tensor(prompts, dtype=torch.long, device=model.device)  # [B, P]
    attention_mask = torch.ones_like(input_ids)
    extra = {"cache_implementation": "static"} if static else {}

    def run(n: int) -> None:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, **extra)
        if out.shape[1] != input_ids.shape[1] + n:
            raise RuntimeError(f"HF generate returned {out.shape[1] - input_ids.shape[1]} tokens, expected {n}")

    return run


def log(contender: str, case: Case, m: dict[str, Any]) -> None:
    print(f"  {contender:18s} {case.key:9s} TTFT {m['ttft_ms']:8.2f} ms  TPOT {m['tpot_ms']:8.3f} ms", flush=True)


def run_hf_peers(args: argparse.Namespace, cases: list[Case], device: torch.device, report: Report,
                 results: dict[str, dict[str, Any]]) -> None:
    holder: dict[str, Any] = {}

    def model() -> Any:
        if "m" not in holder:
            holder["m"] = load_hf_model(args.model, device, args.dtype)
        return holder["m"]

    peer_cases = [replace(c, output_len=min(c.output_len, args.peer_output_len or c.output_len)) for c in cases]

    def eager() -> None:
        for case in peer_cases:
            m = measure_ttft_tpot(hf_run_fn(model(), case.prompts(), static=False), case.output_len,
                                  args.peer_repeats, device, warmup_lens=(1, 8))
            results.setdefault(HF_EAGER, {})[case.key] = {**m, "output_len": case.output_len}
            log(HF_EAGER, case, m)

    def static() -> None:
        sizes = set(parse_int_list(args.hf_static_batch_sizes))
        for case in sorted((c for c in peer_cases if c.batch in sizes), key=lambda c: -c.output_len):
            # The first run(N) compiles; the cache is sized for the largest N seen so far, so later cases reuse it.
            m = measure_ttft_tpot(hf_run_fn(model(), case.prompts(), static=True), case.output_len,
                                  args.peer_repeats, device, warmup_lens=(1, case.output_len))
            results.setdefault(HF_STATIC, {})[case.key] = {**m, "output_len": case.output_len}
            log(HF_STATIC, case, m)

    report.section(HF_EAGER, eager)
    use_static = args.hf_static == "on" or (args.hf_static == "auto" and device.type == "cuda")
    if use_static:
        report.section(HF_STATIC, static)
    holder.clear()
    reset_compiled_state()


def run_ours(args: argparse.Namespace, cases: list[Case], device: torch.device, report: Report,
             results: dict[str, dict[str, Any]]) -> None:
    def body() -> None:
        need = max(c.prompt_len + c.output_len for c in cases)
        if args.max_model_len is not None and args.max_model_len < need:
            raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the workloads' {need} tokens")
        max_len = need if args.max_model_len is None else args.max_model_len
        llm = build_ours(args.model, device, max_model_len=max_len, max_num_seqs=max(256, *(c.batch for c in cases)),
                         enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
                         **({} if args.compilation_config is None else {"compilation_config": args.compilation_config}))
        for case in cases:
            prompts = case.prompts()

            def run(n: int, prompts: list[list[int]] = prompts) -> None:
                ours_generate(llm, prompts, n, temperature=0.0)

            m = measure_ttft_tpot(run, case.output_len, args.repeats, device, warmup_lens=(1, case.output_len))
            results.setdefault(OURS, {})[case.key] = {**m, "output_len": case.output_len}
            log(OURS, case, m)

    report.section(OURS, body)
    reset_compiled_state()


def fill_rows(report: Report, cases: list[Case], results: dict[str, dict[str, Any]]) -> None:
    def get(contender: str, case: Case, metric: str) -> float | None:
        m = results.get(contender, {}).get(case.key)
        return None if m is None else m[metric]

    def note(peer: str, case: Case) -> str:
        n = results.get(peer, {}).get(case.key, {}).get("output_len", case.output_len)
        return f"peer N={n}" if n != case.output_len else ""

    for case in cases:
        peers = [p for p in (HF_EAGER, HF_STATIC) if case.key in results.get(p, {})] or [""]  # "": no peer ran
        if case.workload == "L1":
            report.add(Row("L1", "TTFT", "ms", False, get(OURS, case, "ttft_ms"), peers[0],
                           get(peers[0], case, "ttft_ms")))
            for peer in peers:
                report.add(Row("L1", "TPOT", "ms/token", False, get(OURS, case, "tpot_ms"), peer,
                               get(peer, case, "tpot_ms"), note(peer, case)))
            continue
        for peer in peers:
            ours, theirs = get(OURS, case, "tpot_ms"), get(peer, case, "tpot_ms")
            report.add(Row(case.key, "TPOT", "ms/step", False, ours, peer, theirs, note(peer, case)))
            report.add(Row(case.key, "decode", "tok/s", True, _tok_s(case.batch, ours), peer,
                           _tok_s(case.batch, theirs), note(peer, case)))


def _tok_s(batch: int, tpot_ms: float | None) -> float | None:
    return None if not tpot_ms or tpot_ms <= 0 else batch * 1e3 / tpot_ms


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    device = resolve_device(args.device)
    cases = build_cases(args)
    report = Report("bench_latency", vars(args))
    results: dict[str, dict[str, Any]] = {}
    print(f"device {device}; cases: {', '.join(f'{c.key} P={c.prompt_len} N={c.output_len}' for c in cases)}")
    if not args.no_peer:
        run_hf_peers(args, cases, device, report, results)
    if not args.no_ours:
        run_ours(args, cases, device, report, results)
    report.extra["results"] = results
    fill_rows(report, cases, results)
    report.print_table()
    report.write_json(args.json)
    return report


if __name__ == "__main__":
    main()
