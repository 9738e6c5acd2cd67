"""The `graphrunner` command line: `graphrunner generate [--model DIR] PROMPT...`.

With no --model it runs the demo model shipped inside the package, so the first command works
offline. Bad arguments exit with status 2 and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from graphrunner.sampling_params import SamplingParams


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF-format model directory (default: the shipped demo model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds are drawn from it)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    p.add_argument("--cudagraph-mode", default="full_and_piecewise", choices=("full_and_piecewise", "piecewise", "none"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphrunner", description="Low-latency LLM runner for HF-format models.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts and print the results")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--min-tokens", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--request-seed", type=int, default=None, help="fixed seed for every request")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--compile-cache", default=None, help="a `graphrunner precompile` output directory")
    pre = sub.add_parser("precompile", help="compile the model offline into a cache directory")
    _add_engine_args(pre)
    pre.add_argument("--out", required=True, help="directory for the compiled artifacts and manifest")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from graphrunner.llm import LLM

    params = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
                            min_tokens=args.min_tokens, seed=args.request_seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks_override=args.num_gpu_blocks_override,
              gpu_memory_utilization=args.gpu_memory_utilization, compile_cache=args.compile_cache,
              enforce_eager=args.enforce_eager, cudagraph_mode=args.cudagraph_mode)
    outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    for out in outputs:
        for comp in out.outputs:
            print(f"{out.prompt}{comp.text}")
            print(f"  [{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}]")
    return 0


def _precompile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from graphrunner.engine_args import build_engine_config
    from graphrunner.precompile import precompile

    config = build_engine_config(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                                 max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 num_gpu_blocks_override=args.num_gpu_blocks_override,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 cudagraph_mode=args.cudagraph_mode)
    if args.enforce_eager:
        raise SystemExit("precompile compiles the model: --enforce-eager makes no sense here")
    seconds = precompile(config, Path(args.out))
    print(f"precompiled {config.model_dir} for {config.device} ({config.dtype}) into {args.out} in {seconds:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "precompile":
            return _precompile(args)
    except ValueError as exc:
        print(f"graphrunner: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
