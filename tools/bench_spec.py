"""Speculative decoding benchmark (issue 16): TPOT, time per step and mean acceptance length of our engine with and
without speculation (n-gram, a draft model or an EAGLE head), per workload and batch size.

Workloads: "copy" (each prompt is a random passage followed by its first half, so a model that copies, as trained
models do, continues the passage and prompt lookup finds every draft), "random" (random ids) and "text" (held-out
passages of a trained model's corpus: `--text-ids`, the uint16 ids `train_demo_model.py prepare` writes, e.g.
data/cache/demo_corpus/val.npy). A random-weight model does not copy: its drafts come from its own greedy loops.
"step_ms" is the wall time per engine step while decoding: with speculation it is the cost of a verify step of
1 + k tokens per request, without it the cost of a plain decode step. Example (H200):
  python tools/bench_spec.py --model /tmp/qwen3-0.6b-random --batch-sizes 1,64 --k 4 --disable-by-batch-size 32
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from bench_common import (
    Report,
    Row,
    TritonSpecialisations,
    add_common_args,
    ours_generate,
    parse_int_list,
    resolve_device,
    timed,
    ttft_tpot_ms,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_json="bench_spec.json")
    p.add_argument("--workloads", default="copy,random", help="comma list of copy, random, text")
    p.add_argument("--text-ids", default=None, help="text workload: a .npy of token ids (uint16) to cut prompts from")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--k", default="4", help="num_speculative_tokens: a comma list runs each against one baseline")
    p.add_argument("--method", default="ngram", choices=("ngram", "draft_model", "eagle"))
    p.add_argument("--draft-model", default=None,
                   help="draft_model: the draft's HF-format directory; eagle: the EAGLE head's directory")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--passage-len", type=int, default=200, help="copy workload: passage length (tokens)")
    p.add_argument("--passages", type=int, default=None,
                   help="groups of --batch-sizes prompts generated one after another in each timed run (default: 8 "
                        "for text, whose acceptance varies from passage to passage, else 1); figures are per group")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--interleave", action="store_true",
                   help="all engines of a workload and batch alive at once, timed in turns (host-bound comparisons)")
    args = p.parse_args(argv)
    if args.passages is not None and args.passages < 1:
        p.error(f"--passages must be >= 1, got {args.passages}")
    return args


def prompts_for(workload: str, batch: int, passage_len: int, vocab: int, text_ids: str | None = None) -> list[list[int]]:
    """`batch` prompts of the workload (the same ones in every case of a run: the generator's seed is fixed)."""
    rng = random.Random(0)
    if workload == "text":
        if text_ids is None:
            raise SystemExit("the text workload needs --text-ids (e.g. data/cache/demo_corpus/val.npy)")
        import numpy as np

        ids = np.load(text_ids, mmap_mode="r")
        if len(ids) < passage_len + 1:
            raise SystemExit(f"{text_ids} holds {len(ids)} tokens, fewer than --passage-len {passage_len}")
        starts = [rng.randrange(len(ids) - passage_len) for _ in range(batch)]
        return [[int(t) for t in ids[s:s + passage_len]] for s in starts]
    out = []
    for _ in range(batch):
        passage = [rng.randrange(vocab) for _ in range(passage_len)]
        out.append(passage + passage[: passage_len // 2] if workload == "copy" else passage)
    return out


def _dynamo_frames() -> int:
    """Frames Dynamo has compiled in this process (a re-trace inside a timed repeat shows up here)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class Case:
    """One engine (speculative or not) over a workload at a batch size: built and warmed up, then timed by
    `time()` (one call or several, interleaved with other cases' calls), then `finish()` counts its steps."""

    def __init__(self, args: argparse.Namespace, device: Any, workload: str, batch: int, spec: dict | None,
                 specs: TritonSpecialisations, memory_share: float = 1.0) -> None:
        from graphrunner import LLM

        self.args, self.device, self.specs = args, device, specs
        self.llm = llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=max(batch, 1),
                             device=str(device), enforce_eager=args.enforce_eager,
                             gpu_memory_utilization=args.gpu_memory_utilization * memory_share,
                             speculative_config=spec)
        # a single passage's 127 greedy tokens gave acceptance figures no single per-position rate fits (eighteenth
        # session); several passages, each group at the case's batch size, average over the text
        passages = args.passages if args.passages is not None else (8 if workload == "text" else 1)
        prompts = prompts_for(workload, batch * passages, args.passage_len,
                              min(10000, llm.engine.config.model.vocab_size), args.text_ids)
        self.groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        self.steps = 0
        execute = llm.engine.runner.execute

        def counted(sched: Any) -> Any:
            self.steps += 1
            return execute(sched)

        llm.engine.runner.execute = counted  # type: ignore[method-assign]
        # warm-up over the whole length: a short one left kernel variants (verify steps past the first n-gram
        # hits, the capped steps at the end) to compile inside the first timed repeat (~0.3-0.8 s on the H200,
        # eleventh session)
        self.generate(args.output_len)
        self.generate(1)
        self.mark_start()
        self.t_first: list[float] = []
        self.t_full: list[float] = []

    def mark_start(self) -> None:
        """Count from here: the acceptance counters, and the kernels and frames first seen (an interleaved run
        marks once every engine is built, so that one engine's warm-up is not read as another's timed compile)."""
        stats = self.llm.engine.stats
        self.counts, self.per_pos = stats.spec_decode_counts, stats.spec_accepted_per_pos
        self.mark, self.frames = len(self.specs.seen), _dynamo_frames()

    def generate(self, n: int) -> None:
        for group in self.groups:
            ours_generate(self.llm, group, n, 0.0)

    def time(self, repeats: int) -> None:
        for _ in range(repeats):
            self.t_first.append(timed(lambda: self.generate(1), self.device))
            self.t_full.append(timed(lambda: self.generate(self.args.output_len), self.device))

    def finish(self) -> dict[str, Any]:
        """The figures, per group of prompts: TTFT = median run(1); TPOT = (median run(N) - TTFT) / (N - 1)."""
        args, llm, g = self.args, self.llm, len(self.groups)
        ttft_ms, tpot_ms = ttft_tpot_ms(self.t_first, self.t_full, args.output_len)
        res: dict[str, Any] = {"ttft_ms": ttft_ms / g, "tpot_ms": tpot_ms / g, "t_first_s": self.t_first,
                               "t_full_s": self.t_full, "passages": g}
        after, pos_after = llm.engine.stats.spec_decode_counts, llm.engine.stats.spec_accepted_per_pos
        # a compile inside the timed repeats (a cold cache made one n-gram run 5x slower, twelfth session): name it
        res["new_triton_specialisations"] = self.specs.since(self.mark)
        res["dynamo_frames_compiled"] = _dynamo_frames() - self.frames
        for name in res["new_triton_specialisations"]:
            print(f"    first launched in the timed repeats: {name}", flush=True)
        if res["dynamo_frames_compiled"]:
            print(f"    Dynamo compiled {res['dynamo_frames_compiled']} frame(s) in the timed repeats", flush=True)
        self.steps = 0
        graphs = llm.engine.runner.graphs
        modes = dict(graphs.mode_counts) if graphs is not None else {}
        self.generate(args.output_len)
        decode_steps = self.steps - g  # each group's first step is its prefill
        if graphs is not None:  # how the counted run's steps ran (a verify step that missed its FULL graph shows)
            res["step_modes"] = {m.name: n - modes.get(m, 0) for m, n in graphs.mode_counts.items()
                                 if n - modes.get(m, 0)}
            print(f"    steps by mode: {res['step_modes']}", flush=True)
        res["decode_steps"] = decode_steps
        res["step_ms"] = res["tpot_ms"] * g * (args.output_len - 1) / max(1, decode_steps)
        # tokens each request gains per decode step: below the mean acceptance length when some steps find no
        # draft (acceptance counts only the steps that verified drafts); TPOT ~ step_ms / tokens_per_step
        res["tokens_per_step"] = g * (args.output_len - 1) / max(1, decode_steps)
        drafts, accepted = after[0] - self.counts[0], after[2] - self.counts[2]
        res["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
        res["draft_tokens"] = after[1] - self.counts[1]
        # the share of verify steps whose draft i was accepted: falls with i; its first entries should not depend
        # on k
        res["acceptance_per_pos"] = ([round((b - a) / drafts, 4) for a, b in zip(self.per_pos, pos_after)]
                                     if drafts else [])
        if drafts:
            print(f"    accepted per draft position: {res['acceptance_per_pos']}", flush=True)
        return res


def run_cases(args: argparse.Namespace, device: Any, workload: str, batch: int, specs_list: list[dict | None],
              specs: TritonSpecialisations) -> list[dict[str, Any]]:
    """Each spec's figures (None: no speculation). One engine at a time, or with --interleave all of them alive at
    once, each taking its turn per repeat: the host's speed drifts by up to 2x within minutes on the H200's
    machine (nineteenth session), which a host-bound comparison (batch 64) must not read as the engines'."""
    if not args.interleave:
        out = []
        for spec in specs_list:
            case = Case(args, device, workload, batch, spec, specs)
            case.time(args.repeats)
            out.append(case.finish())
            del case
        return out
    n = len(specs_list)  # each engine's KV budget: its share of --gpu-memory-utilization, after the ones before it
    cases = [Case(args, device, workload, batch, spec, specs, (i + 1) / n) for i, spec in enumerate(specs_list)]
    for case in cases:
        case.mark_start()
    for _ in range(args.repeats):
        for case in cases:
            case.time(1)
    return [case.finish() for case in cases]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = Report("bench_spec", vars(args))
    ks = parse_int_list(args.k)
    spec: dict[str, Any] = {"method": args.method, "disable_by_batch_size": args.disable_by_batch_size}
    if args.method == "ngram":
        spec.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    else:
        if args.draft_model is None:
            raise SystemExit(f"--method {args.method} needs --draft-model DIR")
        spec["model"] = args.draft_model
    specs = TritonSpecialisations()
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        for batch in parse_int_list(args.batch_sizes):
            base, *fasts = run_cases(args, device, workload, batch,
                                     [None, *({**spec, "num_speculative_tokens": k} for k in ks)], specs)
            for k, fast in zip(ks, fasts):
                key = f"{workload} b={batch}" + (f" k={k}" if len(ks) > 1 else "")
                peer = "no spec"
                report.add(Row(key, "TPOT", "ms", False, fast["tpot_ms"], peer, base["tpot_ms"]))
                report.add(Row(key, "step", "ms", False, fast["step_ms"], peer, base["step_ms"],
                               note="verify step vs plain decode step"))
                report.add(Row(key, "mean acceptance length", "tokens", True, fast["mean_acceptance_length"]))
                report.add(Row(key, "tokens per decode step", "tokens", True, fast["tokens_per_step"]))
                report.extra.setdefault("cases", {})[key] = {"no_spec": base, "spec": fast}
                print(f"{workload} b={batch} k={k}: TPOT {base['tpot_ms']:.3f} -> {fast['tpot_ms']:.3f} ms "
                      f"(x{base['tpot_ms'] / fast['tpot_ms']:.2f}), step {base['step_ms']:.3f} -> "
                      f"{fast['step_ms']:.3f} ms, mean acceptance length {fast['mean_acceptance_length']}, tokens "
                      f"per step {fast['tokens_per_step']:.2f}", flush=True)
    report.print_table()
    report.write_json(args.json)


if __name__ == "__main__":
    main()
