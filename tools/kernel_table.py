"""Per-kernel device-time table of a torch.profiler run, grouped as issue 17's table: GEMMs, lm_head, attention,
sampling, Inductor fused kernels, kv write / memcpy, other. Used by bench_step_breakdown.py --profile-steps.

Kernels are grouped by name. The lm_head GEMM has no name of its own: it is the last GEMM-group kernel (with a
split-K reduce, the two last) before each sampling kernel in device-time order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

GROUPS = ("GEMMs (layers)", "lm_head GEMM", "attention", "sampling", "inductor fused", "kv write / memcpy",
          "other")
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (  # first match wins
    ("attention", re.compile(r"unified_attention|merge_splits|paged_attention|flash_|fmha", re.IGNORECASE)),
    ("sampling", re.compile(r"sample|gumbel|penalt|top_?k|top_?p|min_p|logprob|argmax|_filter|bad_word|allowed",
                            re.IGNORECASE)),
    # (_qkv_prep_kernel: the fused q/k norm + rope + KV write, GRAPHRUNNER_FUSED_QKV_PREP)
    ("kv write / memcpy", re.compile(r"write_kv|qkv_prep|memcpy|memset|copy_kernel|CatArrayBatched",
                                     re.IGNORECASE)),
    ("GEMMs (layers)", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitKreduce|split_k_reduce|cublas|triton_tem_"
                                  r"|_mm_|matmul|sm90_|sm80_", re.IGNORECASE)),
    # (_rms_norm_kernel: the GEMV norm prologue's fallback above max_m, standing in for Inductor's norm kernels)
    ("inductor fused", re.compile(r"^triton_(poi|red|per|for)_|^_rms_norm_kernel")),
)
_REDUCE = re.compile(r"splitKreduce|split_k_reduce", re.IGNORECASE)


@dataclass(frozen=True)
class KernelEvent:
    name: str
    start_us: float
    dur_us: float


@dataclass
class KernelRow:
    group: str
    name: str
    total_us: float
    calls: int


def classify(name: str) -> str:
    for group, pattern in _PATTERNS:
        if pattern.search(name):
            return group
    return "other"


def group_events(events: Sequence[KernelEvent]) -> list[tuple[str, KernelEvent]]:
    """(group, event) in start order, with each sampling kernel's preceding GEMM (+ its split-K reduce) as lm_head."""
    ordered = sorted(events, key=lambda e: e.start_us)
    groups = [classify(e.name) for e in ordered]
    for i, g in enumerate(groups):
        if g != "sampling" or (i > 0 and groups[i - 1] == "sampling"):
            continue  # only the first kernel of a run of sampling kernels
        j = i - 1
        while j >= 0 and groups[j] not in ("GEMMs (layers)", "lm_head GEMM"):
            j -= 1
        if j >= 0 and groups[j] == "GEMMs (layers)":
            groups[j] = "lm_head GEMM"
            if _REDUCE.search(ordered[j].name) and j > 0 and groups[j - 1] == "GEMMs (layers)":
                groups[j - 1] = "lm_head GEMM"
    return list(zip(groups, ordered))


def kernel_rows(events: Sequence[KernelEvent]) -> list[KernelRow]:
    """One row per (group, kernel name), biggest total first within the group order of GROUPS."""
    acc: dict[tuple[str, str], KernelRow] = {}
    for group, e in group_events(events):
        row = acc.setdefault((group, e.name), KernelRow(group, e.name, 0.0, 0))
        row.total_us += e.dur_us
        row.calls += 1
    return sorted(acc.values(), key=lambda r: (GROUPS.index(r.group), -r.total_us))


def summarize(rows: Iterable[KernelRow], steps: int, tokens_per_step: int) -> dict:
    """JSON-ready totals per group and per kernel, per step and per token."""
    rows = list(rows)
    out: dict = {"steps": steps, "tokens_per_step": tokens_per_step, "groups": {}, "kernels": []}
    for g in GROUPS:
        mine = [r for r in rows if r.group == g]
        total = sum(r.total_us for r in mine)
        calls = sum(r.calls for r in mine)
        out["groups"][g] = {"us_per_step": total / steps, "us_per_token": total / (steps * tokens_per_step),
                            "calls_per_step": calls / steps}
    out["device_us_per_step"] = sum(r.total_us for r in rows) / steps
    out["kernels"] = [{**asdict(r), "us_per_step": r.total_us / steps, "calls_per_step": r.calls / steps}
                      for r in rows]
    return out


def format_table(summary: dict, top: int = 4) -> str:
    """The issue's table (group: us/token, calls/token) with each group's `top` biggest kernels under it."""
    tps = summary["tokens_per_step"]
    lines = [f"{'kernels':<58} {'us/token':>9} {'calls/token':>12} {'us/step':>9}", "-" * 92]
    for g, v in summary["groups"].items():
        if v["calls_per_step"] == 0:
            continue
        lines.append(f"{g:<58} {v['us_per_token']:9.1f} {v['calls_per_step'] / tps:12.2f} {v['us_per_step']:9.1f}")
        for k in [k for k in summary["kernels"] if k["group"] == g][:top]:
            name = k["name"] if len(k["name"]) <= 54 else k["name"][:51] + "..."
            lines.append(f"    {name:<54} {k['us_per_step'] / tps:9.1f} {k['calls_per_step'] / tps:12.2f}")
    lines.append("-" * 92)
    dev = summary["device_us_per_step"]
    lines.append(f"{'device total':<58} {dev / tps:9.1f} {'':>12} {dev:9.1f}")
    return "\n".join(lines)


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def events_from_chrome_trace(path: str | Path) -> list[KernelEvent]:
    """Device-side events (kernels, memcpys, memsets) of a torch.profiler chrome trace; kernels inside CUDA graph
    replays are there when CUPTI reports them (recent torch/CUDA do)."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [KernelEvent(str(e["name"]), float(e["ts"]), float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and str(e.get("cat", "")).lower() in DEVICE_CATEGORIES]


def _short(name: str) -> str:
    """A kernel's name without its Triton/CUDA decorations (leading underscores, template arguments), 40 chars."""
    return re.sub(r"[<(].*$", "", name).strip("_")[:40]


def critical_path(events: Sequence[KernelEvent], steps: int, idle_cap_us: float = 50.0) -> dict:
    """What each kernel adds to the device timeline's length when kernels overlap (PDL): kernels in end order, each
    charged end - max(its start, the latest end before it), the rest of its time hidden under its predecessors. A
    kernel is named with the one ending before it ("gemv after add_rms_norm"), which tells the layer's GEMVs apart.
    Gaps up to `idle_cap_us` are idle device time inside a step (charged as "idle"); longer ones lie between steps
    and are left out. Returns {"us_per_step": {label: us}, "span_us_per_step": total} (JSON-ready)."""
    ordered = sorted(events, key=lambda e: e.start_us + e.dur_us)
    charged: dict[str, float] = {}
    latest, prev = None, "start"
    for e in ordered:
        end = e.start_us + e.dur_us
        label = f"{_short(e.name)} after {prev}"
        if latest is None:
            exposed, gap = e.dur_us, 0.0
        else:
            exposed = max(0.0, end - max(e.start_us, latest))
            gap = max(0.0, e.start_us - latest)
        if gap <= idle_cap_us:
            charged["idle"] = charged.get("idle", 0.0) + gap
        charged[label] = charged.get(label, 0.0) + exposed
        latest = end if latest is None else max(latest, end)
        prev = _short(e.name)
    per_step = {k: v / steps for k, v in sorted(charged.items(), key=lambda kv: -kv[1])}
    return {"us_per_step": per_step, "span_us_per_step": sum(per_step.values())}


def format_critical_path(path: dict, top: int = 20) -> str:
    lines = [f"{'exposed time (critical path)':<70} {'us/step':>9}", "-" * 80]
    for label, us in list(path["us_per_step"].items())[:top]:
        lines.append(f"  {label[:68]:<68} {us:9.1f}")
    lines.append(f"{'span (sum of the above and the rest)':<70} {path['span_us_per_step']:9.1f}")
    return "\n".join(lines)
