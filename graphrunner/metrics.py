"""Engine statistics with vLLM's offline metrics API (`LLM.get_metrics()` -> `list[Metric]`) and Prometheus text.

`EngineStats` is fed timestamps by the engine (it never reads a clock, so tests are deterministic); every event is
O(1). `snapshot()` returns vLLM's `Metric` dataclasses under vLLM's `vllm:` names; `to_prometheus_text()` renders
the same numbers in the Prometheus text exposition format (no prometheus_client needed). Standard library only.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

# --- vLLM's metric records (vllm.v1.metrics.reader): same class names, fields and field order -----------------


@dataclass
class Metric:
    """A metric sample set: a name and its key=value labels (one name may appear with several label sets)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM uses it for per-position spec-decode acceptance)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in fixed buckets: `buckets` maps the upper bound as a string ("0.001", ..., "+Inf") to the
    CUMULATIVE count of observations <= that bound; `count` equals the "+Inf" bucket; `sum` is the total."""

    count: int
    sum: float
    buckets: dict[str, int]


# --- bucket bounds (vLLM's defaults) ---------------------------------------------------------------------------

REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: float) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to and including `max_value` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


def format_float(value: float) -> str:
    """A float as Prometheus (and so vLLM's reader) spells it: "0.5", "1.0", "1e+06", "+Inf", "NaN"."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to exponent notation from 1e6 on
        mantissa = f"{text[0]}.{text[1:dot]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


class BucketHistogram:
    """A histogram with fixed upper bounds (an implicit +Inf last): O(log buckets) observe, cumulative export.

    An observation v falls in the first bucket whose bound b satisfies v <= b (Prometheus `le` semantics).
    """

    __slots__ = ("_counts", "_sum", "bounds")

    def __init__(self, bounds: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in bounds)
        if any(not math.isfinite(b) for b in bounds) or any(a >= b for a, b in pairwise(bounds)):
            raise ValueError(f"histogram bounds must be finite and strictly increasing, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last = (bounds[-1], +Inf)
        self._sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Record `value` `n` times."""
        self._counts[bisect_left(self.bounds, value)] += n
        self._sum += value * n

    @property
    def count(self) -> int:
        return sum(self._counts)

    @property
    def sum(self) -> float:
        return self._sum

    def cumulative(self) -> list[int]:
        """Cumulative counts, one per bound and a last one for +Inf (== count)."""
        out, running = [], 0
        for c in list(self._counts):
            running += c
            out.append(running)
        return out

    def to_metric(self, name: str, labels: Mapping[str, str]) -> Histogram:
        cumulative = self.cumulative()
        keys = [format_float(b) for b in self.bounds] + ["+Inf"]
        return Histogram(name=name, labels=dict(labels), count=cumulative[-1], sum=self._sum,
                         buckets=dict(zip(keys, cumulative)))


@dataclass
class RequestMetrics:
    """Per-request timestamps with vLLM's `RequestOutput.metrics` field names (the engine's clock, in seconds)."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None


METRIC_HELP: dict[str, str] = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions": "Cumulative number of preemptions from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:request_success": "Count of finished requests, by finished_reason.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed, per finished request.",
    "vllm:request_generation_tokens": "Number of generation tokens processed, per finished request.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts (requests verified with at least one draft).",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
}


class EngineStats:
    """Engine-wide counters, gauges and latency histograms, plus per-request timestamps until a request finishes.

    Every method takes the caller's clock (`now`, e.g. time.monotonic()) and does O(1) work. Events for an unknown
    request id raise KeyError (the engine must call `request_added` first and `request_finished` exactly once).
    Token counters: `prompt_tokens(n)` and `tokens_generated(...)` feed vllm:prompt_tokens / vllm:generation_tokens;
    the per-request totals passed to `request_finished` only feed the per-request histograms.
    """

    def __init__(self, max_model_len: int = 8192, labels: Mapping[str, str] | None = None,
                 num_speculative_tokens: int = 0) -> None:
        self.labels: dict[str, str] = dict(labels or {})  # constant labels on every metric, e.g. model_name
        self._num_spec = num_speculative_tokens  # > 0: speculative decoding is on and its counters are exported
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted = 0
        self._spec_accepted_per_pos = [0] * num_speculative_tokens
        self._running = 0
        self._waiting = 0
        self._kv_usage = 0.0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._ttft = BucketHistogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self._itl = BucketHistogram(INTER_TOKEN_LATENCY_BUCKETS)
        self._e2e = BucketHistogram(REQUEST_LATENCY_BUCKETS)
        self._queue = BucketHistogram(REQUEST_LATENCY_BUCKETS)
        token_bounds = build_1_2_5_buckets(max_model_len)
        self._req_prompt = BucketHistogram(token_bounds)
        self._req_generation = BucketHistogram(token_bounds)
        self._requests: dict[str, RequestMetrics] = {}

    # --- per-request events -----------------------------------------------------------------------------------

    def _get(self, request_id: str) -> RequestMetrics:
        state = self._requests.get(request_id)
        if state is None:
            raise KeyError(f"request {request_id!r} is not tracked (never added, or already finished)")
        return state

    def request_added(self, request_id: str, now: float) -> None:
        """A request arrived (`now` is its arrival time)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already tracked")
        self._requests[request_id] = RequestMetrics(arrival_time=now, last_token_time=now)

    def request_scheduled(self, request_id: str, now: float) -> None:
        """The request got into a batch. Only the first call counts (queue time = now - arrival); later ones,
        e.g. after a preemption, are no-ops."""
        state = self._get(request_id)
        if state.first_scheduled_time is None:
            state.first_scheduled_time = now
            state.time_in_queue = now - state.arrival_time
            self._queue.observe(state.time_in_queue)

    def tokens_generated(self, request_id: str, num_tokens: int, now: float) -> None:
        """`num_tokens` new output tokens at `now`. The first call records TTFT = now - arrival; each later call
        records, for each of its tokens, an inter-token latency of (now - previous call) / num_tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        state = self._get(request_id)
        if num_tokens == 0:
            return
        self._generation_tokens += num_tokens
        if state.first_token_time is None:
            state.first_token_time = now
            self._ttft.observe(now - state.arrival_time)
        else:
            self._itl.observe((now - state.last_token_time) / num_tokens, num_tokens)
        state.last_token_time = now

    def request_finished(self, request_id: str, finish_reason: str, now: float, num_prompt_tokens: int,
                         num_generation_tokens: int) -> RequestMetrics:
        """The request ended ("stop", "length", "abort", "error", ...): records e2e latency, the per-request token
        histograms and request_success{finished_reason}; forgets the request and returns its final metrics."""
        state = self._get(request_id)
        del self._requests[request_id]
        state.finished_time = now
        self._e2e.observe(now - state.arrival_time)
        self._success[finish_reason] = self._success.get(finish_reason, 0) + 1
        self._req_prompt.observe(num_prompt_tokens)
        self._req_generation.observe(num_generation_tokens)
        return state

    def request_metrics(self, request_id: str) -> RequestMetrics:
        """A copy of the request's timestamps so far (for RequestOutput.metrics); built field by field, which costs a
        fifth of dataclasses.replace (the server asks for one per request per step)."""
        m = self._get(request_id)
        return RequestMetrics(m.arrival_time, m.last_token_time, m.first_scheduled_time, m.first_token_time,
                              m.time_in_queue, m.finished_time)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    # --- engine-wide events and per-step gauges ---------------------------------------------------------------

    def prompt_tokens(self, n: int) -> None:
        """`n` prompt (prefill) tokens were processed."""
        self._prompt_tokens += n

    def preempted(self, n: int = 1) -> None:
        self._preemptions += n

    def prefix_cache(self, queries: int, hits: int) -> None:
        """A prefix-cache lookup over `queries` tokens found `hits` of them cached."""
        if not 0 <= hits <= queries:
            raise ValueError(f"need 0 <= hits <= queries, got hits={hits}, queries={queries}")
        self._prefix_queries += queries
        self._prefix_hits += hits

    def spec_decode(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One verify step: per request, drafts verified and of those accepted (a leading run)."""
        for d, a in zip(num_drafts, num_accepted):
            if not 0 <= a <= d:
                raise ValueError(f"need 0 <= accepted <= drafts, got accepted={a}, drafts={d}")
            if d:
                self._spec_drafts += 1
                self._spec_draft_tokens += d
                self._spec_accepted += a
                for pos in range(min(a, len(self._spec_accepted_per_pos))):
                    self._spec_accepted_per_pos[pos] += 1

    @property
    def spec_accepted_per_pos(self) -> tuple[int, ...]:
        """Verify steps so far whose draft at position i (0-based) was accepted, per position."""
        return tuple(self._spec_accepted_per_pos)

    @property
    def spec_decode_counts(self) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted tokens) so far; mean acceptance length = 1 + accepted / drafts."""
        return self._spec_drafts, self._spec_draft_tokens, self._spec_accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified request-step that had drafts (1 + accepted / drafts; 0 before any)."""
        return 1.0 + self._spec_accepted / self._spec_drafts if self._spec_drafts else 0.0

    def set_running(self, n: int) -> None:
        self._running = n

    def set_waiting(self, n: int) -> None:
        self._waiting = n

    def set_kv_cache_usage(self, fraction: float) -> None:
        """Fraction (0..1) of KV-cache blocks in use."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"kv cache usage is a fraction in [0, 1], got {fraction}")
        self._kv_usage = float(fraction)

    # --- export -----------------------------------------------------------------------------------------------

    def snapshot(self) -> list[Metric]:
        """All metrics now, as vLLM's `LLM.get_metrics()` returns them (fresh objects, safe to keep)."""
        labels = self.labels
        gauges = [("vllm:num_requests_running", self._running), ("vllm:num_requests_waiting", self._waiting),
                  ("vllm:kv_cache_usage_perc", self._kv_usage)]
        counters = [("vllm:prefix_cache_queries", self._prefix_queries), ("vllm:prefix_cache_hits", self._prefix_hits),
                    ("vllm:num_preemptions", self._preemptions), ("vllm:prompt_tokens", self._prompt_tokens),
                    ("vllm:generation_tokens", self._generation_tokens)]
        histograms = [("vllm:time_to_first_token_seconds", self._ttft), ("vllm:inter_token_latency_seconds", self._itl),
                      ("vllm:e2e_request_latency_seconds", self._e2e), ("vllm:request_queue_time_seconds", self._queue),
                      ("vllm:request_prompt_tokens", self._req_prompt),
                      ("vllm:request_generation_tokens", self._req_generation)]
        out: list[Metric] = [Gauge(name=n, labels=dict(labels), value=float(v)) for n, v in gauges]
        out += [Counter(name=n, labels=dict(labels), value=int(v)) for n, v in counters]
        out += [Counter(name="vllm:request_success", labels={**labels, "finished_reason": reason}, value=count)
                for reason, count in list(self._success.items())]
        out += [h.to_metric(n, labels) for n, h in histograms]
        if self._num_spec:
            out += [Counter(name=n, labels=dict(labels), value=v) for n, v in (
                ("vllm:spec_decode_num_drafts", self._spec_drafts),
                ("vllm:spec_decode_num_draft_tokens", self._spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", self._spec_accepted))]
            out.append(Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=dict(labels),
                              values=list(self._spec_accepted_per_pos)))
        return out

    def to_prometheus_text(self) -> str:
        """The snapshot in the Prometheus text exposition format (version 0.0.4)."""
        return render_prometheus(self.snapshot(), METRIC_HELP)


# --- Prometheus text exposition ------------------------------------------------------------------------------


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {format_float(value)}"
    body = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
    return f"{name}{{{body}}} {format_float(value)}"


def _samples(metric: Metric) -> list[str]:
    if isinstance(metric, Histogram):
        lines = [_sample(f"{metric.name}_bucket", {**metric.labels, "le": le}, n) for le, n in metric.buckets.items()]
        lines.append(_sample(f"{metric.name}_count", metric.labels, metric.count))
        lines.append(_sample(f"{metric.name}_sum", metric.labels, metric.sum))
        return lines
    if isinstance(metric, Vector):  # exported as vLLM does: one counter per position label
        return [_sample(f"{metric.name}_total", {**metric.labels, "position": str(i)}, v)
                for i, v in enumerate(metric.values)]
    if isinstance(metric, Counter):
        return [_sample(f"{metric.name}_total", metric.labels, metric.value)]
    if isinstance(metric, Gauge):
        return [_sample(metric.name, metric.labels, metric.value)]
    raise TypeError(f"cannot render metric of type {type(metric).__name__}")


def render_prometheus(metrics: Iterable[Metric], help_texts: Mapping[str, str] | None = None) -> str:
    """Metrics in the Prometheus text format: one HELP/TYPE block per name (counters and vectors get `_total`,
    histograms `_bucket{le=..}`, `_count`, `_sum`); metrics sharing a name are grouped in first-seen order."""
    groups: dict[str, list[Metric]] = {}
    for metric in metrics:
        groups.setdefault(metric.name, []).append(metric)
    lines: list[str] = []
    for name, group in groups.items():
        first = group[0]
        kind = ("histogram" if isinstance(first, Histogram) else "counter" if isinstance(first, (Counter, Vector))
                else "gauge")
        exposed = f"{name}_total" if kind == "counter" else name
        help_text = (help_texts or {}).get(name, name).replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {exposed} {help_text}", f"# TYPE {exposed} {kind}"]
        for metric in group:
            lines += _samples(metric)
    return "\n".join(lines) + "\n" if lines else ""
