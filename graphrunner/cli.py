"""The `graphrunner` command line: `graphrunner generate [--model DIR] [--stream] PROMPT...`, `graphrunner serve`
(an OpenAI-compatible server) and `graphrunner precompile`.

With no --model it runs the demo model shipped inside the package, so the first command works
offline. Every `SamplingParams` field is a `generate` flag, generated from the dataclass fields so
none is forgotten (`seed` is `--request-seed`: `--seed` is the engine's seed). Bad arguments exit
with status 2 and a one-line `graphrunner: error: ...` message, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from graphrunner import __version__
from graphrunner.argparse_utils import json_value
from graphrunner.sampling_params import SamplingParams

if typing.TYPE_CHECKING:
    from graphrunner.llm import LLM
    from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput

# SamplingParams fields with no command-line form.
SKIPPED_FIELDS = frozenset({"extra_args", "output_kind"})
# Flag names that differ from the field name (`--seed` is the engine seed).
FLAG_NAMES = {"seed": "--request-seed"}
# Deliberate CLI defaults that differ from SamplingParams' (a readable demo; see docs/DEMO_MODEL.md).
CLI_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.7}
FIELD_HELP = {
    "n": "completions per prompt",
    "best_of": "candidates per prompt (only best_of == n is supported)",
    "presence_penalty": "penalty on tokens already generated, in [-2, 2]",
    "frequency_penalty": "penalty per occurrence of a generated token, in [-2, 2]",
    "repetition_penalty": "multiplicative penalty on prompt and generated tokens (1 = off)",
    "temperature": "0 = greedy",
    "top_p": "nucleus sampling mass, in (0, 1]",
    "top_k": "keep the k most likely tokens (-1 = off)",
    "min_p": "drop tokens below min_p x the top probability",
    "seed": "fixed seed for every request (none: drawn from --seed)",
    "stop": "stop string (repeatable)",
    "stop_token_ids": "stop token id (repeatable)",
    "bad_words": "word never to generate (repeatable)",
    "ignore_eos": "keep generating after the end-of-sequence token",
    "max_tokens": "tokens to generate per completion",
    "min_tokens": "tokens to generate before EOS / stop strings may end a completion",
    "logprobs": "print each generated token's logprob and the top N alternatives",
    "prompt_logprobs": "print each prompt token's logprob and the top N alternatives",
    "detokenize": "turn generated tokens into text",
    "skip_special_tokens": "leave special tokens out of the text",
    "spaces_between_special_tokens": "put spaces between special tokens in the text",
    "include_stop_str_in_output": "keep the matched stop string in the text",
    "logit_bias": "add BIAS to token ID's logit (repeatable)",
    "allowed_token_ids": "only ever generate these token ids (repeatable)",
    "truncate_prompt_tokens": "keep only the last N prompt tokens",
}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `graphrunner: error: ...`, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"graphrunner: error: {message} (see `{self.prog} --help`)\n")


# -- flags ------------------------------------------------------------------------------------
def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF-format model directory; none: the shipped demo model")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, help="cuda | cpu; none: $GRAPHRUNNER_DEVICE, else cuda when available")
    p.add_argument("--max-model-len", type=int, default=None, help="none: from the model's config.json")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV-cache blocks; none: measured")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use")
    p.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds are drawn from it)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile, no CUDA graphs")
    p.add_argument("--cudagraph-mode", default="full_and_piecewise",
                   choices=("full_and_piecewise", "full", "piecewise", "none"), help="CUDA graphs to capture (CUDA only)")
    p.add_argument("--compilation-config", "-O", type=json_value, default=None,
                   help='vLLM\'s compilation config: a level (0 = no torch.compile, no graphs; 3 = the default) or '
                        'JSON, e.g. \'{"level": 0, "cudagraph_mode": "FULL"}\' (FULL graphs of the uncompiled '
                        'model: the fastest start-up)')
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes computed before")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps (off: a prompt is admitted only whole)")
    p.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs a request may ask for")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices (one process each: GPUs 0..N-1 with NCCL, or gloo on CPU)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the model's generation_config.json) | vllm (none) | a directory")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\'')


_ENGINE_FLAGS = ("model", "dtype", "device", "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "num_gpu_blocks_override", "gpu_memory_utilization", "enforce_eager", "cudagraph_mode", "block_size",
                 "enable_prefix_caching", "enable_chunked_prefill", "max_logprobs", "generation_config",
                 "tensor_parallel_size", "speculative_config", "compilation_config")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments (EngineArgs fields) of a parsed generate / precompile / serve command line."""
    kwargs = {name: getattr(args, name) for name in _ENGINE_FLAGS}
    if getattr(args, "compile_cache", None) is not None:
        kwargs["compile_cache"] = args.compile_cache
    return kwargs


def _logit_bias_item(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 42=-1.5), got {text!r}") from None


def _field_kind(tp: Any) -> tuple[str, type | None] | None:
    """How a field of type `tp` is given on the command line: (kind, value type), or None if it cannot be."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    if args == [bool]:
        return "bool", bool
    for a in args:
        inner = typing.get_args(a)
        if typing.get_origin(a) is list and len(inner) == 1 and inner[0] in (int, float, str):
            return "list", inner[0]
        if typing.get_origin(a) is dict and inner == (int, float):
            return "logit_bias", None
    for base in (float, int, str):  # `int | bool` (logprobs=True) is an int flag
        if base in args:
            return "scalar", base
    return None


def _field_types() -> dict[str, Any]:
    """Each field's resolved type; None for an annotation that does not resolve (that field gets no flag)."""
    try:
        return typing.get_type_hints(SamplingParams)
    except (NameError, TypeError, AttributeError, SyntaxError):
        namespace = vars(sys.modules[SamplingParams.__module__])
        resolved: dict[str, Any] = {}
        for f in dataclasses.fields(SamplingParams):
            try:
                resolved[f.name] = eval(f.type, namespace) if isinstance(f.type, str) else f.type
            except (NameError, TypeError, AttributeError, SyntaxError):
                resolved[f.name] = None
        return resolved


def sampling_fields() -> dict[str, tuple[str, str, type | None]]:
    """Field name -> (flag, kind, value type) for every SamplingParams field the command line sets."""
    types_ = _field_types()
    out: dict[str, tuple[str, str, type | None]] = {}
    for f in dataclasses.fields(SamplingParams):
        kind = None if f.name in SKIPPED_FIELDS else _field_kind(types_.get(f.name))
        if kind is not None:
            out[f.name] = (FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-")), *kind)
    return out


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("sampling (SamplingParams fields)")
    defaults = SamplingParams()
    for name, (flag, kind, value_type) in sampling_fields().items():
        default = CLI_DEFAULTS.get(name, getattr(defaults, name))
        text = FIELD_HELP.get(name, f"SamplingParams.{name}")
        if name in CLI_DEFAULTS:
            text += f"; SamplingParams' default is {getattr(defaults, name)!r}"
        dest = "sp_" + name
        metavar = {int: "ID", str: "TEXT"}.get(value_type, "X") if kind == "list" else name.upper()
        if kind == "bool" and default:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=True, help=text)
        elif kind == "bool":
            group.add_argument(flag, dest=dest, action="store_true", help=text)
        elif kind == "list":
            group.add_argument(flag, dest=dest, action="append", type=value_type, default=None,
                               metavar=metavar, help=text)
        elif kind == "logit_bias":
            group.add_argument(flag, dest=dest, action="append", type=_logit_bias_item, default=None,
                               metavar="ID=BIAS", help=text)
        else:
            group.add_argument(flag, dest=dest, type=value_type, default=default, metavar=metavar, help=text)


def build_sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The SamplingParams of parsed `generate` arguments (raises ValueError on out-of-range values)."""
    kwargs: dict[str, Any] = {}
    for name, (_, kind, _) in sampling_fields().items():
        value = getattr(args, "sp_" + name)
        if value is None:
            continue  # not given, and the dataclass default is None or an empty list
        kwargs[name] = dict(value) if kind == "logit_bias" else value
    return SamplingParams(**kwargs)


def _add_serve_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    srv = sub.add_parser("serve", help="run an OpenAI-compatible HTTP server", formatter_class=fmt,
                         description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /tokenize, "
                                     "/detokenize, /version and /metrics over HTTP.")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind")
    srv.add_argument("--port", type=int, default=8000, help="port to bind")
    srv.add_argument("--api-key", default=None,
                     help="require `Authorization: Bearer KEY` on /v1 routes (default: $GRAPHRUNNER_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use; none: the model path")
    srv.add_argument("--max-waiting-requests", type=int, default=None,
                     help="answer 429 when more sequences than this wait for a slot; none: unbounded")
    srv.add_argument("--compile-cache", default=None, help="a `graphrunner precompile` output directory")
    srv.add_argument("--log-level", default="info", help="uvicorn log level")
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                     help="run the engine loop in its own process, where HTTP work cannot hold its GIL "
                          "(--no-engine-process: a thread of the server process)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="graphrunner", description="Low-latency LLM runner for HF-format models.")
    parser.add_argument("--version", action="version", version=f"graphrunner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts and print the results", formatter_class=fmt,
                         description="Complete each PROMPT with the model and print prompt + completion, then "
                                     "`[N tokens, finish_reason=...]` per completion.")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--compile-cache", default=None, help="a `graphrunner precompile` output directory")
    gen.add_argument("--stream", action="store_true", help="print the text as it is generated")
    _add_sampling_args(gen)
    _add_serve_parser(sub, fmt)
    pre = sub.add_parser("precompile", help="compile the model offline into a cache directory", formatter_class=fmt)
    _add_engine_args(pre)
    pre.add_argument("--out", required=True, help="directory for the compiled artifacts and manifest")
    return parser


# -- printing ---------------------------------------------------------------------------------
def _token_text(token: int, lp: Logprob | None) -> str:
    return repr(lp.decoded_token) if lp is not None and lp.decoded_token is not None else f"<{token}>"


def _logprob_line(token: int, entry: dict[int, Logprob] | None, top: int) -> str:
    """`'tok' -0.1234  top: 'a' -0.1234, 'b' -2.5000` for one position (the token, then the top N)."""
    chosen = entry.get(token) if entry else None
    if entry is None or chosen is None:
        return f"    {_token_text(token, chosen)}  (no logprob)"
    alts = sorted((lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top)
    line = f"    {_token_text(token, chosen)} {chosen.logprob:.4f}"
    if chosen.rank is not None and chosen.rank > 1:
        line += f" (rank {chosen.rank})"
    if alts:
        line += "  top: " + ", ".join(f"{_token_text(tid, lp)} {lp.logprob:.4f}" for _, tid, lp in alts)
    return line


def _print_logprobs(title: str, tokens: Sequence[int], entries: Iterable[dict[int, Logprob] | None] | None,
                    top: int | None) -> None:
    if entries is None or top is None:
        return
    print(f"  {title} (top {int(top)}):")
    for token, entry in zip(tokens, entries):
        print(_logprob_line(token, entry, int(top)))


def _print_completion_end(comp: CompletionOutput, params: SamplingParams) -> None:
    """What follows a completion's text: its summary line, then its token logprobs if asked for."""
    print(f"  [{len(comp.token_ids)} tokens, finish_reason={comp.finish_reason}]")
    _print_logprobs("logprobs", comp.token_ids, comp.logprobs, params.logprobs)


def _print_request(out: RequestOutput, params: SamplingParams) -> None:
    for comp in out.outputs:
        print(f"{out.prompt or ''}{comp.text}")
        _print_completion_end(comp, params)
    _print_logprobs("prompt logprobs", out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs)


class _StreamPrinter:
    """Prints one request's completions one after another, each as its text arrives.

    Completion i + 1 is buffered (the engine yields them all) until completion i is done. While a
    completion runs, the last (longest stop string - 1) characters are held back: a stop string
    completing later truncates the text there.
    """

    def __init__(self, prompt: str, params: SamplingParams) -> None:
        self.prompt, self.params = prompt, params
        self.hold = max((len(s) for s in params.stop or []), default=1) - 1
        self.index, self.printed, self.started = 0, 0, False

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def feed(self, out: RequestOutput, final: bool = False) -> None:
        while self.index < len(out.outputs):
            comp = out.outputs[self.index]
            if not self.started:  # the prompt once the request is accepted, i.e. with its first output
                self._write(self.prompt)
                self.started = True
            done = final or comp.finished()
            limit = len(comp.text) if done else max(self.printed, len(comp.text) - self.hold)
            self._write(comp.text[self.printed:limit])
            self.printed = limit
            if not done:
                return
            print()
            _print_completion_end(comp, self.params)
            self.index, self.printed, self.started = self.index + 1, 0, False
        if out.finished or final:
            _print_logprobs("prompt logprobs", out.prompt_token_ids, out.prompt_logprobs, self.params.prompt_logprobs)


def _stream(llm: LLM, prompts: Sequence[str], params: SamplingParams) -> None:
    """One prompt after another, each printed as it is generated."""
    for prompt in prompts:
        printer, last = _StreamPrinter(prompt, params), None
        for out in llm.stream(prompt, params):
            printer.feed(out)
            last = out
        if last is not None and not last.finished:
            printer.feed(last, final=True)


# -- commands ---------------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
    params = build_sampling_params(args)  # before the engine (and torch) loads: a bad value fails fast
    from graphrunner.llm import LLM

    llm = LLM(**engine_kwargs(args))
    if args.stream:
        _stream(llm, args.prompts, params)
        return 0
    for out in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        _print_request(out, params)
    return 0


def _precompile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from graphrunner.engine_args import build_engine_config
    from graphrunner.precompile import precompile

    if args.enforce_eager:
        raise ValueError("precompile compiles the model: --enforce-eager makes no sense here")
    config = build_engine_config(**{k: v for k, v in engine_kwargs(args).items() if k != "compile_cache"})
    seconds = precompile(config, Path(args.out))
    print(f"precompiled {config.model_dir} for {config.device} ({config.dtype}) into {args.out} in {seconds:.1f} s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os
    import signal

    import uvicorn

    from graphrunner.async_llm import AsyncLLM
    from graphrunner.engine_args import EngineArgs
    from graphrunner.engine_core import SWITCH_INTERVAL_S
    from graphrunner.server import build_app

    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    engine_args = EngineArgs(**engine_kwargs(args))
    # The thread that hands outputs over (the engine loop, or the engine-core process's reader) and the HTTP
    # event loop share this process's GIL. With Python's default 5 ms switch interval an output handed over waits
    # up to 5 ms for the HTTP thread to run (TTFT and ITL pay it); 0.5 ms bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    llm = AsyncLLM.from_engine_args(engine_args, args.max_waiting_requests, engine_process=args.engine_process)
    app = build_app(llm, args.served_model_name or args.model, args.api_key or os.environ.get("GRAPHRUNNER_API_KEY"))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=10)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; a no-op handler makes that a clean exit 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run()
    finally:
        llm.shutdown(abort=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "precompile":
            return _precompile(args)
        if args.command == "serve":
            return _serve(args)
    except ValueError as exc:
        print(f"graphrunner: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, as `cat` does; stdout goes to devnull so that the
        # interpreter's final flush of what is still buffered does not raise again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, the status a shell reports for a pipe's writer that stopped on it
    parser.error(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
