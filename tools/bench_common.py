"""Shared pieces of the benchmark tools: workload generation, timing, our engine and HF model loading, reporting.

The benchmark scripts (bench_latency.py, bench_throughput.py) stay thin: they describe their workloads and peers
and call into this module. Workloads and metrics are defined in /work/shared/BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python tools/bench_x.py` without installing the package
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_MODEL = "/tmp/qwen3-0.6b-random"
PROMPT_VOCAB = 10000  # prompt token ids are uniform in [0, PROMPT_VOCAB)


# ----------------------------------------------------------------------------------------------- workloads
def random_prompts(num: int, min_len: int, max_len: int, seed: int = 0, vocab: int = PROMPT_VOCAB) -> list[list[int]]:
    """`num` prompts: per request, a length uniform in [min_len, max_len], then ids uniform in [0, vocab).

    Uses its own `random.Random(seed)` (the same stream as `random.seed(seed)`), so prompt i does not depend on
    `num` and the batch-b prompts of L2 are a prefix of the batch-128 ones.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(vocab) for _ in range(length)])
    return prompts


def parse_int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def check_lengths(outputs: Sequence[Sequence[int]], expected: int, who: str) -> None:
    """Every request must produce exactly `expected` tokens (ignore-EOS workloads), or the timing is meaningless."""
    bad = [i for i, toks in enumerate(outputs) if len(toks) != expected]
    if bad:
        got = sorted({len(outputs[i]) for i in bad})
        raise RuntimeError(f"{who}: {len(bad)} of {len(outputs)} requests did not produce {expected} tokens "
                           f"(lengths seen: {got[:5]})")


# ----------------------------------------------------------------------------------------------- timing
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 3,
              before: Callable[[], Any] | None = None) -> float:
    """Median milliseconds of fn() over `iters` calls after `warmup` (CUDA events on a GPU, wall clock
    on CPU); `before` runs untimed ahead of each call (e.g. an L2 flush)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall seconds of fn(), with the device drained before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def measure_ttft_tpot(run: Callable[[int], Any], output_len: int, repeats: int, device: torch.device,
                      warmup_lens: Sequence[int] = (1, 8)) -> dict[str, Any]:
    """TTFT = time of run(1); TPOT = (median time of run(N) - median time of run(1)) / (N - 1).

    `run(n)` generates n tokens for the whole batch. `warmup_lens` are run once first (compiled peers need N
    itself in there, because their graphs depend on the cache length).
    """
    for n in warmup_lens:
        run(n)
    t_first, t_full = [], []
    for _ in range(max(1, repeats)):
        t_first.append(timed(lambda: run(1), device))
        t_full.append(timed(lambda: run(output_len), device))
    ttft_ms, tpot_ms = ttft_tpot_ms(t_first, t_full, output_len)
    return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "t_first_s": t_first, "t_full_s": t_full}


def ttft_tpot_ms(t_first: Sequence[float], t_full: Sequence[float], output_len: int) -> tuple[float, float]:
    """(TTFT, TPOT) in ms from the seconds of repeated run(1) and run(output_len): TTFT = median run(1), TPOT =
    (median run(N) - TTFT) / (N - 1)."""
    first, full = statistics.median(t_first), statistics.median(t_full)
    return first * 1e3, (full - first) * 1e3 / max(1, output_len - 1)


# ----------------------------------------------------------------------------------------------- engines
class TritonSpecialisations:
    """Every Triton kernel specialisation this process launches for the first time (Triton's jit_cache_hook): a
    run that adds some paid for a compile or a cache load mid-run, a warm-up effect (issue 19). Inductor's own
    kernels do not pass through this hook."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        try:
            from triton import knobs
        except ImportError:  # an older Triton: names stay unknown
            return
        previous = knobs.runtime.jit_cache_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(str(kwargs.get("repr", kwargs.get("fn", "?"))))
            return previous(*args, **kwargs) if previous is not None else False

        knobs.runtime.jit_cache_hook = hook

    def since(self, mark: int, limit: int = 12, width: int = 240) -> list[str]:
        """The specialisations first seen after len(self.seen) was `mark`, shortened for a log."""
        return [r[:width] for r in self.seen[mark:mark + limit]]


def build_ours(model: str, device: torch.device, max_model_len: int, max_num_seqs: int, enforce_eager: bool,
               gpu_memory_utilization: float, seed: int = 0, enable_prefix_caching: bool = True,
               **engine_args: Any) -> Any:
    """Our engine through its public, vLLM-compatible API (`engine_args`: further LLM keyword arguments)."""
    from graphrunner import LLM

    return LLM(model=model, dtype="auto", seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization, device=str(device),
               enable_prefix_caching=enable_prefix_caching, **engine_args)


def ours_generate(llm: Any, prompts: Sequence[list[int]], max_tokens: int, temperature: float,
                  detokenize: bool = False, **sampling: float) -> list[list[int]]:
    """One llm.generate() over token-id prompts; returns the generated ids per request (exactly max_tokens).
    `sampling`: further SamplingParams fields (e.g. repetition_penalty)."""
    from graphrunner import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=detokenize,
                            **sampling)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    check_lengths(ids, max_tokens, "ours")
    return ids


def load_hf_model(model: str, device: torch.device, dtype: str = "auto") -> Any:
    """The HF peer: AutoModelForCausalLM with SDPA attention in the checkpoint's dtype ("auto") on `device`."""
    from transformers import AutoModelForCausalLM

    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, attn_implementation="sdpa")
    return hf.to(device).eval()


def release() -> None:
    """Give device memory back before the next contender runs (callers drop their references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_compiled_state() -> None:
    """Forget torch.compile caches/graphs from a compiled peer (frees its CUDA-graph pools)."""
    with contextlib.suppress(Exception):  # best-effort cleanup only
        torch._dynamo.reset()
    release()


# ----------------------------------------------------------------------------------------------- reporting
@dataclass
class Row:
    """One line of the result table: our figure, the peer's, and the speedup (> 1: ours is better)."""

    workload: str
    metric: str
    unit: str
    higher_is_better: bool
    ours: float | None = None
    peer_name: str = ""
    peer: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.ours is None or self.peer is None or self.ours <= 0 or self.peer <= 0:
            return None  # missing, or a noisy negative TPOT
        return self.ours / self.peer if self.higher_is_better else self.peer / self.ours


@dataclass
class Report:
    """Collects rows and section errors; prints the table and writes JSON."""

    script: str
    args: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def section(self, name: str, fn: Callable[[], None]) -> bool:
        """Runs one contender; a failure is printed and recorded, and the other contenders still run."""
        t0 = time.perf_counter()
        try:
            fn()
            ok = True
        except Exception:  # noqa: BLE001 - a benchmark run must report what it could measure
            traceback.print_exc()
            self.errors[name] = traceback.format_exc(limit=8)
            ok = False
        print(f"[{name}] {'done' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s", flush=True)
        self.extra.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        return ok

    def print_table(self) -> None:
        header = ["workload", "metric", "ours", "peer", "peer value", "speedup", "note"]
        lines = [[r.workload, f"{r.metric} ({r.unit})", _fmt(r.ours), r.peer_name or "-", _fmt(r.peer),
                  f"{r.speedup:.2f}x" if r.speedup else "-", r.note] for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
        for i, line in enumerate([header, *lines]):
            print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())
            if i == 0:
                print("  ".join("-" * w for w in widths))
        for name in self.errors:
            print(f"section {name!r} failed (traceback above and in the JSON)")

    def to_json(self) -> dict[str, Any]:
        rows = [{**asdict(r), "speedup": r.speedup} for r in self.rows]
        return {"script": self.script, "env": env_info(), "args": self.args, "rows": rows, "errors": self.errors,
                **self.extra}

    def write_json(self, path: str | None) -> None:
        if not path:
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")
        print(f"wrote {path}")


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if abs(x) >= 100 else f"{x:.3g}"


def env_info() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "host": platform.node(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                        check=False, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def add_common_args(p: Any, default_json: str) -> None:
    """Flags every benchmark script accepts."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF-format model dir (tools/make_bench_model.py)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--dtype", default="auto", help="HF peer dtype: auto (checkpoint dtype, bf16) or e.g. float32")
    p.add_argument("--no-peer", action="store_true", help="skip the HF peers")
    p.add_argument("--no-ours", action="store_true", help="skip our engine (peer-only runs)")
    p.add_argument("--enforce-eager", action="store_true", help="ours: no CUDA graphs / compilation")
    p.add_argument("--compilation-config", type=json.loads, default=None,
                   help='ours: vLLM\'s compilation_config as JSON, e.g. \'{"level": 0, "cudagraph_mode": "FULL"}\' '
                        '(the uncompiled model\'s FULL graphs)')
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="ours (peers run first and are freed)")
    p.add_argument("--json", default=default_json, help="where to write the JSON results (default %(default)s)")
