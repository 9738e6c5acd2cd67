"""graphrunner.metrics: vLLM's Metric records, EngineStats with deterministic timestamps, Prometheus text."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import re
import subprocess
import sys
from bisect import bisect_right

import numpy as np
import pytest

from graphrunner.metrics import (
    FINISH_REASONS,
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    BucketHistogram,
    Counter,
    EngineStats,
    Gauge,
    Histogram,
    Metric,
    RequestMetrics,
    Vector,
    build_1_2_5_buckets,
    format_float,
    render_prometheus,
)

LABELS = {"model_name": "tiny", "engine": "0"}


def by_name(metrics: list[Metric], name: str, **labels: str) -> Metric:
    found = [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def reference_buckets(bounds: tuple[float, ...] | list[float], samples: list[float]) -> dict[str, int]:
    """Cumulative counts of samples <= each bound, computed two independent ways (numpy and bisect)."""
    arr = np.asarray(samples, dtype=np.float64)
    ordered = sorted(samples)
    out = {}
    for b in bounds:
        n = int(np.count_nonzero(arr <= b))
        assert n == bisect_right(ordered, b)
        out[format_float(b)] = n
    out["+Inf"] = len(samples)
    return out


# --- records and helpers ---------------------------------------------------------------------------------------


def test_metric_records_match_vllm_reader() -> None:
    fields = {cls.__name__: [f.name for f in dataclasses.fields(cls)] for cls in (Metric, Counter, Gauge, Vector,
                                                                               Histogram)}
    assert fields == {"Metric": ["name", "labels"], "Counter": ["name", "labels", "value"],
                      "Gauge": ["name", "labels", "value"], "Vector": ["name", "labels", "values"],
                      "Histogram": ["name", "labels", "count", "sum", "buckets"]}
    assert all(issubclass(c, Metric) for c in (Counter, Gauge, Vector, Histogram))
    assert [f.name for f in dataclasses.fields(RequestMetrics)] == [
        "arrival_time", "last_token_time", "first_scheduled_time", "first_token_time", "time_in_queue",
        "finished_time"]


def test_format_float_and_token_buckets() -> None:
    assert [format_float(x) for x in (0.001, 1, 2.5, 7680.0, 100000.0, 1e6, 2e7, math.inf)] == [
        "0.001", "1.0", "2.5", "7680.0", "100000.0", "1e+06", "2e+07", "+Inf"]
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


@pytest.mark.parametrize("bounds", [TIME_TO_FIRST_TOKEN_BUCKETS, INTER_TOKEN_LATENCY_BUCKETS,
                                    REQUEST_LATENCY_BUCKETS])
def test_bucket_histogram_matches_reference(bounds: tuple[float, ...]) -> None:
    rng = np.random.default_rng(0)
    samples = list(rng.uniform(0.0, bounds[-1] * 1.2, size=300)) + list(rng.exponential(0.3, size=300))
    samples += [bounds[0], bounds[3], bounds[-1], 0.0]  # values exactly on a bound count as <= it
    hist = BucketHistogram(bounds)
    for s in samples:
        hist.observe(float(s))
    metric = hist.to_metric("h", {"a": "b"})
    assert metric.buckets == reference_buckets(bounds, samples)
    assert list(metric.buckets)[-1] == "+Inf" and metric.count == len(samples) == hist.count
    assert metric.sum == pytest.approx(float(np.sum(samples)), rel=1e-12)
    assert list(metric.buckets.values()) == sorted(metric.buckets.values())  # cumulative


def test_bucket_histogram_observe_n_and_bounds_check() -> None:
    hist = BucketHistogram([1.0, 2.0])
    hist.observe(1.5, 4)
    hist.observe(3.0)
    assert hist.cumulative() == [0, 4, 5] and hist.sum == 9.0
    for bad in ([2.0, 1.0], [1.0, 1.0], [1.0, math.inf]):
        with pytest.raises(ValueError, match="strictly increasing"):
            BucketHistogram(bad)


# --- EngineStats ----------------------------------------------------------------------------------------------


def run_two_requests() -> tuple[EngineStats, RequestMetrics, RequestMetrics]:
    """Dyadic timestamps, so every derived latency is exact in binary floating point."""
    stats = EngineStats(max_model_len=1000, labels=LABELS)
    stats.request_added("a", 10.0)
    stats.request_added("b", 10.5)
    stats.set_waiting(2)
    stats.request_scheduled("a", 10.25)          # queue 0.25
    stats.prompt_tokens(7)
    stats.tokens_generated("a", 1, 11.0)         # TTFT 1.0
    stats.request_scheduled("b", 11.5)           # queue 1.0
    stats.prompt_tokens(3)
    stats.tokens_generated("a", 1, 11.125)       # ITL 0.125
    stats.tokens_generated("b", 1, 11.625)       # TTFT 1.125
    stats.preempted()
    stats.request_scheduled("a", 12.0)           # re-scheduled after preemption: no new queue sample
    stats.tokens_generated("a", 4, 12.125)       # 4 tokens over 1.0 s: ITL 0.25 x4
    stats.tokens_generated("b", 0, 13.0)         # nothing generated: no-op
    stats.prefix_cache(queries=16, hits=8)
    stats.prefix_cache(queries=4, hits=0)
    stats.set_running(1)
    stats.set_waiting(0)
    stats.set_kv_cache_usage(0.375)
    live = stats.request_metrics("a")
    final_a = stats.request_finished("a", "length", 12.5, num_prompt_tokens=7, num_generation_tokens=6)
    final_b = stats.request_finished("b", "abort", 14.5, num_prompt_tokens=3, num_generation_tokens=1)
    assert live == dataclasses.replace(final_a, finished_time=None) and live is not final_a
    return stats, final_a, final_b


def test_request_metrics_exact() -> None:
    _, a, b = run_two_requests()
    assert a == RequestMetrics(arrival_time=10.0, last_token_time=12.125, first_scheduled_time=10.25,
                               first_token_time=11.0, time_in_queue=0.25, finished_time=12.5)
    assert b == RequestMetrics(arrival_time=10.5, last_token_time=11.625, first_scheduled_time=11.5,
                               first_token_time=11.625, time_in_queue=1.0, finished_time=14.5)


def test_snapshot_values_exact() -> None:
    stats, _, _ = run_two_requests()
    snap = stats.snapshot()
    assert stats.num_tracked_requests == 0  # per-request state freed
    gauges = {m.name: m.value for m in snap if isinstance(m, Gauge)}
    assert gauges == {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 0.0,
                      "vllm:kv_cache_usage_perc": 0.375}
    counters = {(m.name, m.labels.get("finished_reason")): m.value for m in snap if isinstance(m, Counter)}
    assert counters == {("vllm:prefix_cache_queries", None): 20, ("vllm:prefix_cache_hits", None): 8,
                        ("vllm:num_preemptions", None): 1, ("vllm:prompt_tokens", None): 10,
                        ("vllm:generation_tokens", None): 7, ("vllm:request_success", "stop"): 0,
                        ("vllm:request_success", "length"): 1, ("vllm:request_success", "abort"): 1,
                        ("vllm:request_success", "error"): 0}
    samples = {"vllm:time_to_first_token_seconds": [1.0, 1.125], "vllm:inter_token_latency_seconds": [0.125] + [0.25] * 4,
               "vllm:e2e_request_latency_seconds": [2.5, 4.0], "vllm:request_queue_time_seconds": [0.25, 1.0],
               "vllm:request_prompt_tokens": [7, 3], "vllm:request_generation_tokens": [6, 1]}
    bounds = {"vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
              "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS,
              "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
              "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
              "vllm:request_prompt_tokens": build_1_2_5_buckets(1000),
              "vllm:request_generation_tokens": build_1_2_5_buckets(1000)}
    hists = {m.name: m for m in snap if isinstance(m, Histogram)}
    assert set(hists) == set(samples)
    for name, values in samples.items():
        h = hists[name]
        assert (h.count, h.sum) == (len(values), sum(values)), name  # exact: dyadic values
        assert h.buckets == reference_buckets(bounds[name], values), name
    assert all(m.labels.items() >= LABELS.items() for m in snap)


def test_snapshot_names_types_and_independence() -> None:
    stats = EngineStats(max_model_len=64)
    snap = stats.snapshot()
    kinds = [(m.name, type(m).__name__) for m in snap if m.name != "vllm:request_success"]
    assert kinds == [
        ("vllm:num_requests_running", "Gauge"), ("vllm:num_requests_waiting", "Gauge"),
        ("vllm:kv_cache_usage_perc", "Gauge"), ("vllm:prefix_cache_queries", "Counter"),
        ("vllm:prefix_cache_hits", "Counter"), ("vllm:num_preemptions", "Counter"),
        ("vllm:prompt_tokens", "Counter"), ("vllm:generation_tokens", "Counter"),
        ("vllm:time_to_first_token_seconds", "Histogram"), ("vllm:inter_token_latency_seconds", "Histogram"),
        ("vllm:e2e_request_latency_seconds", "Histogram"), ("vllm:request_queue_time_seconds", "Histogram"),
        ("vllm:request_prompt_tokens", "Histogram"), ("vllm:request_generation_tokens", "Histogram")]
    success = [m for m in snap if m.name == "vllm:request_success"]
    assert [m.labels["finished_reason"] for m in success] == list(FINISH_REASONS)
    assert all(isinstance(m, Counter) and m.value == 0 for m in success)
    assert list(by_name(snap, "vllm:request_prompt_tokens").buckets) == [
        "1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]
    snap[0].labels["x"] = "y"  # mutating a snapshot leaves the recorder alone
    stats.set_running(3)
    assert by_name(snap, "vllm:num_requests_running").value == 0.0
    assert stats.snapshot()[0].labels == {} and stats.snapshot()[0].value == 3.0


def test_unknown_finish_reason_gets_its_own_label() -> None:
    stats = EngineStats()
    stats.request_added("r", 0.0)
    stats.request_finished("r", "timeout", 1.0, 1, 0)
    assert by_name(stats.snapshot(), "vllm:request_success", finished_reason="timeout").value == 1


def test_error_cases() -> None:
    stats = EngineStats()
    stats.request_added("r", 0.0)
    with pytest.raises(ValueError, match="already tracked"):
        stats.request_added("r", 1.0)
    for call in (lambda: stats.request_scheduled("x", 1.0), lambda: stats.tokens_generated("x", 1, 1.0),
                 lambda: stats.request_metrics("x"), lambda: stats.request_finished("x", "stop", 1.0, 1, 1)):
        with pytest.raises(KeyError, match="not tracked"):
            call()
    with pytest.raises(ValueError, match="num_tokens"):
        stats.tokens_generated("r", -1, 1.0)
    with pytest.raises(ValueError, match="hits"):
        stats.prefix_cache(queries=2, hits=3)
    with pytest.raises(ValueError, match="fraction"):
        stats.set_kv_cache_usage(1.5)
    stats.request_finished("r", "stop", 2.0, 1, 0)
    with pytest.raises(KeyError):
        stats.request_finished("r", "stop", 3.0, 1, 0)  # exactly once


def test_vllm_example_loop_runs() -> None:
    stats, _, _ = run_two_requests()
    metrics = stats.snapshot() + [Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={},
                                         values=[3, 1])]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for metric in metrics:  # vLLM's examples/offline_inference/metrics.py loop, unchanged
            if isinstance(metric, Gauge):
                print(f"{metric.name} (gauge) = {metric.value}")
            elif isinstance(metric, Counter):
                print(f"{metric.name} (counter) = {metric.value}")
            elif isinstance(metric, Vector):
                print(f"{metric.name} (vector) = {metric.values}")
            elif isinstance(metric, Histogram):
                print(f"{metric.name} (histogram)")
                print(f"    sum = {metric.sum}")
                print(f"    count = {metric.count}")
                for bucket_le, value in metric.buckets.items():
                    print(f"    {bucket_le} = {value}")
    out = buf.getvalue().splitlines()
    assert "vllm:kv_cache_usage_perc (gauge) = 0.375" in out
    assert out.count("vllm:request_success (counter) = 1") == 2
    assert "vllm:spec_decode_num_accepted_tokens_per_pos (vector) = [3, 1]" in out
    i = out.index("vllm:time_to_first_token_seconds (histogram)")
    assert out[i + 1:i + 3] == ["    sum = 2.125", "    count = 2"]
    assert "    +Inf = 2" in out[i + 3:i + 3 + len(TIME_TO_FIRST_TOKEN_BUCKETS) + 1]


# --- Prometheus text ------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')


def parse_prometheus(text: str) -> tuple[dict[str, str], dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(HELP by name, TYPE by name, samples) from the text format, strict line by line."""
    helps, types, samples = {}, {}, []
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("counter", "gauge", "histogram")
            types[name] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, line
            labels = {}
            if m.group(2):
                pos = 0
                for lm in _LABEL.finditer(m.group(2)):
                    assert lm.start() == pos, line
                    labels[lm.group(1)] = lm.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                    pos = lm.end()
                assert pos == len(m.group(2)), line
            samples.append((m.group(1), labels, float(m.group(3))))
    return helps, types, samples


def test_prometheus_text_parses_with_expected_values() -> None:
    stats, _, _ = run_two_requests()
    helps, types, samples = parse_prometheus(stats.to_prometheus_text())
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:prompt_tokens_total"] == "counter" and "vllm:prompt_tokens" not in types
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert set(helps) == set(types) and all(helps.values())
    assert len(types) == 15
    values = {(n, tuple(sorted(lab.items()))): v for n, lab, v in samples}
    assert len(values) == len(samples)  # no duplicate series

    def get(name: str, **extra: str) -> float:
        return values[(name, tuple(sorted({**LABELS, **extra}.items())))]

    assert get("vllm:kv_cache_usage_perc") == 0.375
    assert get("vllm:num_preemptions_total") == 1 and get("vllm:generation_tokens_total") == 7
    assert get("vllm:request_success_total", finished_reason="length") == 1
    assert get("vllm:request_success_total", finished_reason="stop") == 0
    assert get("vllm:e2e_request_latency_seconds_sum") == 6.5
    assert get("vllm:e2e_request_latency_seconds_count") == 2
    assert get("vllm:e2e_request_latency_seconds_bucket", le="2.5") == 1
    assert get("vllm:e2e_request_latency_seconds_bucket", le="5.0") == 2
    assert get("vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 2
    itl = [(lab["le"], v) for n, lab, v in samples if n == "vllm:inter_token_latency_seconds_bucket"]
    assert itl == [(format_float(b), float(c)) for b, c in zip(INTER_TOKEN_LATENCY_BUCKETS + (math.inf,),
                                                                 reference_buckets(INTER_TOKEN_LATENCY_BUCKETS,
                                                                                   [0.125] + [0.25] * 4).values())]
    # every sample line belongs to a declared family
    for name, _, _ in samples:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in types or (base in types and types[base] == "histogram"), name


def test_prometheus_escaping_and_vector() -> None:
    nasty = 'a"b\\c\nd'
    text = render_prometheus([Gauge("g", {"model_name": nasty}, 1.5), Counter("c", {}, 3),
                              Vector("v", {"k": "x"}, [4, 5])], {"g": "line1\nline2"})
    assert "\n\n" not in text
    helps, types, samples = parse_prometheus(text)
    assert helps["g"] == "line1\\nline2"
    assert types == {"g": "gauge", "c_total": "counter", "v_total": "counter"}
    assert samples == [("g", {"model_name": nasty}, 1.5), ("c_total", {}, 3.0),
                       ("v_total", {"k": "x", "position": "0"}, 4.0), ("v_total", {"k": "x", "position": "1"}, 5.0)]
    assert render_prometheus([]) == ""


def test_metrics_module_is_stdlib_only() -> None:
    code = ("import sys, graphrunner.metrics; "
            "bad = [m for m in ('torch', 'numpy', 'graphrunner.engine', 'graphrunner.llm', 'graphrunner.worker') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
