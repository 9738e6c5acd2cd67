"""The serving CI load test, against a real `graphrunner serve` process on the demo model (CPU).

1,000 requests at concurrency 64, half of them streamed and a tenth of all cancelled mid-stream (the client
closes the stream after 2 of 8 tokens): completed + cancelled = submitted, failed = 0, and once the server has
drained, /metrics shows 0 running, 0 waiting and 0 % KV cache usage. Skips while `graphrunner.server` does not
exist. Drives the server with tools/bench_serve.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from serve_harness import load_bench_serve, start_server

pytest.importorskip("graphrunner.server")

bs = load_bench_serve()

NUM_REQUESTS, CONCURRENCY, MAX_TOKENS = 1000, 64, 8
DRAINED = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0, "vllm:kv_cache_usage_perc": 0.0}


async def _load_then_drain(base_url: str, drain_timeout_s: float = 60.0) -> tuple[Any, dict[str, float]]:
    model = await bs.discover_model(base_url)
    result = await bs.run_load(
        base_url, model, bs.default_prompts(200, seed=0), num_requests=NUM_REQUESTS, concurrency=CONCURRENCY,
        max_tokens=MAX_TOKENS, stream_fraction=0.5, cancel_fraction=0.1, cancel_after=2,
        extra_body={"ignore_eos": True}, timeout_s=120.0, seed=0)
    deadline = time.monotonic() + drain_timeout_s  # aborts of closed streams may take a step or two
    while True:
        metrics = await bs.scrape_metrics(base_url)
        gauges = {name: metrics.get(name) for name in DRAINED}
        if gauges == DRAINED or time.monotonic() > deadline:
            return result, gauges
        await asyncio.sleep(0.2)


def test_1000_requests_at_concurrency_64_then_drained(tmp_path: Path) -> None:
    server = start_server([], {"GRAPHRUNNER_DEVICE": "cpu"}, timeout_s=180, log_dir=tmp_path)
    try:
        result, gauges = asyncio.run(_load_then_drain(server.base_url))
    finally:
        rc = server.stop(timeout_s=60)
    print(result.table())
    diagnostics = f"server exit code {rc}, log {server.stderr_path}:\n{server.log_tail()}"
    assert result.submitted == NUM_REQUESTS
    assert result.failed == 0, f"{result.errors}\n{diagnostics}"
    assert result.completed + result.cancelled == NUM_REQUESTS
    # every planned cancel closed its stream after its 2nd content chunk, unless the stream had fewer: the server
    # merges the deltas that queued up while a client lagged, so under load 8 tokens can arrive in one chunk
    plans = bs.plan_requests(bs.default_prompts(200, seed=0), NUM_REQUESTS, stream_fraction=0.5, cancel_fraction=0.1,
                             cancel_after=2, seed=0)
    records = {r.index: r for r in result.records}
    planned = [p.index for p in plans if p.cancel_after is not None]
    assert len(planned) == NUM_REQUESTS // 10
    missed = [i for i in planned if records[i].status != bs.CANCELLED]
    assert all(records[i].status == bs.COMPLETED and records[i].chunks < 2 for i in missed), \
        [(i, records[i].status, records[i].chunks) for i in missed]
    assert result.cancelled == len(planned) - len(missed) and len(missed) < len(planned) // 2
    assert result.max_in_flight == CONCURRENCY
    assert all(r.output_tokens == MAX_TOKENS for r in result.records if r.status == bs.COMPLETED and not r.stream)
    assert gauges == DRAINED, diagnostics
    assert rc != -9, f"graphrunner serve did not exit within 60 s of SIGTERM\n{diagnostics}"
