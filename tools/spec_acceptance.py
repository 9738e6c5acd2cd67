"""Acceptance per draft position of a model proposer, for each k and each way of running the step (eager, compiled
without graphs, piecewise graphs, FULL graphs): greedy decoding of held-out text, so the target's tokens are the same
in every run and a draft position's acceptance must not depend on k or on the mode. A figure that does names the
path that drafts worse (issue 16: on the H200 the trained pair accepted 2.10 tokens a step at k = 2 against 3.26 at
k = 4, which no single per-position rate gives). Example (the demo model drafting for itself through a head
trained on CPU, `train_demo_model.py train-eagle --device cpu --max-steps 400 --batch-size 8 --seq-len 256`):
  python tools/spec_acceptance.py --model graphrunner/demo_model --draft-model data/cache/demo_eagle --k 2,4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, which puts the repo root on sys.path
import bench_common
from bench_spec import prompts_for

from graphrunner import LLM, SamplingParams

MODES = ("eager", "none", "piecewise", "full_and_piecewise")


def run(args: argparse.Namespace, device: str, mode: str, k: int, prompts: list[list[int]]) -> dict[str, Any]:
    spec = {"method": args.method, "num_speculative_tokens": k, "model": args.draft_model}
    graphs = {} if mode == "eager" else {"cudagraph_mode": mode}
    llm = LLM(model=args.model, device=device, max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max(8, args.batch), enforce_eager=mode == "eager", speculative_config=spec, **graphs)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    tokens: list[list[int]] = []
    for i in range(0, len(prompts), args.batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + args.batch]], sp, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    steps, _, accepted = llm.engine.stats.spec_decode_counts
    per_pos = [round(n / steps, 4) for n in llm.engine.stats.spec_accepted_per_pos] if steps else []
    graph_modes = {}
    if llm.engine.runner.graphs is not None:
        graph_modes = {m.name: n for m, n in llm.engine.runner.graphs.mode_counts.items() if n}
    return {"mode": mode, "k": k, "verify_steps": steps, "mean_acceptance_length": 1 + accepted / steps if steps else None,
            "acceptance_per_pos": per_pos, "step_modes": graph_modes, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", required=True, help="the draft's (eagle: the head's) directory")
    ap.add_argument("--method", default="eagle", choices=("eagle", "draft_model"))
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--modes", default=None, help=f"comma list of {', '.join(MODES)} (default: eager on CPU, all on CUDA)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--text-ids", default="data/cache/demo_corpus/val.npy")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1, help="requests generated together")
    ap.add_argument("--json", default="spec_acceptance.json")
    args = ap.parse_args()
    if min(args.prompts, args.prompt_len, args.max_tokens, args.batch) < 1:
        ap.error("--prompts, --prompt-len, --max-tokens and --batch must be >= 1")
    device = str(bench_common.resolve_device(args.device))
    modes = args.modes.split(",") if args.modes else (["eager"] if device == "cpu" else list(MODES))
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes {unknown}: expected some of {', '.join(MODES)}")
    prompts = prompts_for("text", args.prompts, args.prompt_len, 0, args.text_ids)
    results = []
    for mode in modes:
        for k in bench_common.parse_int_list(args.k):
            r = run(args, device, mode, k, prompts)
            same = "" if not results else f", tokens == first run's: {r['tokens'] == results[0]['tokens']}"
            mean = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.3f}"
            print(f"{mode:>18} k={k}: mean acceptance {mean} over {r['verify_steps']} "
                  f"verify steps, per position {r['acceptance_per_pos']}, steps {r['step_modes']}{same}", flush=True)
            results.append(r)
    Path(args.json).write_text(json.dumps({"args": vars(args), "env": bench_common.env_info(), "runs": results}))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
