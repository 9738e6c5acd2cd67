"""tools/bench_serve.py against a fake OpenAI-compatible server (FastAPI + uvicorn in a thread on 127.0.0.1).

The fake streams deterministic tokens (" t0", " t1", ...) with a first-chunk delay and a per-chunk delay, sends
usage when asked, answers HTTP 500 for prompts starting with "FAIL", holds prompts starting with "SLOW" until the
client hangs up, counts requests in flight (and their maximum) and streams closed by the client, and serves /metrics.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from serve_harness import free_port, load_bench_serve

bs = load_bench_serve()

FIRST_DELAY_S = 0.03
CHUNK_DELAY_S = 0.005
SLOW_S = 10.0  # a SLOW request's longest wait; it ends sooner, when its client gives up
METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="fake",engine="0"} 2.0
vllm:num_requests_running{model_name="fake",engine="1"} 1
vllm:num_requests_waiting{model_name="fake"} 0.0
vllm:kv_cache_usage_perc{model_name="fake"} 0.25
vllm:prompt_tokens_total{model_name="fake"} 1.5e3

vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="fake"} 7.0
odd_labels{path="a}b \\"q\\" c",x="y"} 3 1700000000000
no_labels 42
nan_gauge NaN
"""


class FakeServer:
    def __init__(self) -> None:
        self.tokens_per_chunk = 1
        self.lock = threading.Lock()
        self.reset()
        self.app = fastapi.FastAPI()
        self.app.post("/v1/completions")(self._completions)
        self.app.post("/v1/chat/completions")(self._chat)
        self.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        self.app.get("/health")(lambda: PlainTextResponse(""))
        self.app.get("/metrics")(lambda: PlainTextResponse(METRICS_TEXT))

    def reset(self) -> None:
        self.tokens_per_chunk = 1
        self.in_flight = self.max_in_flight = self.disconnects = self.requests = 0
        self.auth: list[str | None] = []

    def _enter(self) -> None:
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self, disconnected: bool = False) -> None:
        with self.lock:
            self.in_flight -= 1
            self.disconnects += disconnected

    async def _completions(self, request: fastapi.Request) -> Any:
        body = await request.json()
        return await self._answer(request, body, body["prompt"], chat=False)

    async def _chat(self, request: fastapi.Request) -> Any:
        body = await request.json()
        return await self._answer(request, body, body["messages"][-1]["content"], chat=True)

    async def _answer(self, request: fastapi.Request, body: dict, prompt: str, chat: bool) -> Any:
        self.auth.append(request.headers.get("authorization"))
        if prompt.startswith("FAIL"):
            return JSONResponse({"error": {"message": f"fake failure for {prompt!r}"}}, status_code=500)
        self._enter()
        if prompt.startswith("SLOW"):  # waits until the client hangs up, so that no handler outlives its test
            deadline = time.monotonic() + SLOW_S
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self._leave(disconnected=True)
                    return JSONResponse({"error": {"message": "client went away"}}, status_code=499)
                await asyncio.sleep(0.01)
        tokens = [f" t{i}" for i in range(body["max_tokens"])]
        usage = {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3 + len(tokens)}
        if body.get("stream"):
            with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._events(tokens, usage if with_usage else None, chat),
                                     media_type="text/event-stream")
        await asyncio.sleep(FIRST_DELAY_S + CHUNK_DELAY_S * (len(tokens) - 1))
        self._leave()
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": "".join(tokens)}} if chat
                      else {"text": "".join(tokens)})
        return {"id": "x", "object": "text_completion", "model": body["model"], "choices": [choice], "usage": usage}

    async def _events(self, tokens: list[str], usage: dict | None, chat: bool) -> Any:
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def choice(text: str) -> dict:
            return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

        done = False
        try:
            if chat:  # a role-only first chunk, at once: not content, so not the first token
                yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(FIRST_DELAY_S)
            step = self.tokens_per_chunk
            for k in range(0, len(tokens), step):
                if k:
                    await asyncio.sleep(CHUNK_DELAY_S)
                yield ": a comment line\n" + event({"choices": [choice("".join(tokens[k:k + step]))]})
            if usage is not None:
                yield event({"choices": [], "usage": usage})
            self._leave()
            done = True
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self._leave(disconnected=True)


@pytest.fixture(scope="module")
def fake_server() -> Any:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    fake.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the fake server did not start"
        time.sleep(0.02)
    yield fake
    server.should_exit = True
    thread.join(10)
    sock.close()
    assert not thread.is_alive(), "the fake server did not stop"


@pytest.fixture
def fake(fake_server: FakeServer) -> FakeServer:
    fake_server.reset()
    return fake_server


@pytest.fixture(params=["httpx", "aiohttp"])
def client(request: pytest.FixtureRequest) -> str:
    """Each load test runs with both HTTP client libraries bench_serve can use."""
    if request.param == "aiohttp":
        pytest.importorskip("aiohttp")
    return request.param


def _run(fake: FakeServer, prompts: list[str], **kw: Any) -> Any:
    kw = {"num_requests": 40, "max_tokens": 4, "concurrency": 8, "timeout_s": 10.0, "seed": 1, **kw}
    return asyncio.run(bs.run_load(fake.base_url, "fake-model", prompts, **kw))


def _wait_for(cond: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


PROMPTS = [f"prompt number {i}" for i in range(7)]


# ----------------------------------------------------------------------------------------------- load runs
def test_mixed_load_counts_failures_and_cancels(fake: FakeServer, client: str) -> None:
    prompts = [*PROMPTS, "FAIL here"]  # request i fails when i % 8 == 7
    kw = {"stream_fraction": 0.5, "cancel_fraction": 0.25, "seed": 3}
    res = _run(fake, prompts, client=client, **kw)
    plans = bs.plan_requests(prompts, 40, **kw)
    fails = {p.index for p in plans if p.prompt.startswith("FAIL")}
    cancels = {p.index for p in plans if p.cancel_after is not None} - fails
    assert res.completed + res.cancelled + res.failed == res.submitted == 40
    assert res.failed == len(fails) == 5
    assert {r.index for r in res.records if r.status == bs.FAILED} == fails
    assert {r.index for r in res.records if r.status == bs.CANCELLED} == cancels
    assert res.cancelled == len(cancels)
    assert len(res.errors) == 5 and all("HTTP 500" in e and "fake failure" in e for e in res.errors)
    assert sum(r.stream for r in res.records) == 20
    done = [r for r in res.records if r.status == bs.COMPLETED]
    assert all(r.output_tokens == 4 for r in done) and res.total_output_tokens == 4 * len(done)
    assert res.request_throughput == pytest.approx(res.completed / res.duration_s)
    assert res.output_throughput == pytest.approx(res.total_output_tokens / res.duration_s)


def test_cancel_fraction_is_exact_and_closes_the_stream(fake: FakeServer, client: str) -> None:
    # 30 tokens: the server is still streaming (for 140 ms more) when the client closes, also on a busy machine
    res = _run(fake, PROMPTS, client=client, stream_fraction=1.0, cancel_fraction=0.25, cancel_after=2, max_tokens=30)
    assert (res.completed, res.cancelled, res.failed) == (30, 10, 0)
    cancelled = [r for r in res.records if r.status == bs.CANCELLED]
    assert all(r.chunks == 2 and r.output_tokens == 2 and len(r.itl_s) == 1 for r in cancelled)
    # the server sees the closed streams (it notices a disconnect at its next write at the latest)
    assert _wait_for(lambda: fake.disconnects == 10 and fake.in_flight == 0), (fake.disconnects, fake.in_flight)
    # the choice is a function of the seed alone
    again = bs.plan_requests(PROMPTS, 40, stream_fraction=1.0, cancel_fraction=0.25, cancel_after=2, seed=1)
    assert {p.index for p in again if p.cancel_after} == {r.index for r in cancelled}
    other = bs.plan_requests(PROMPTS, 40, stream_fraction=1.0, cancel_fraction=0.25, cancel_after=2, seed=2)
    assert {p.index for p in other if p.cancel_after} != {r.index for r in cancelled}


def test_statistics_match_a_reference(fake: FakeServer, client: str) -> None:
    res = _run(fake, PROMPTS, client=client, stream_fraction=0.75, max_tokens=5)
    assert res.failed == 0 and res.cancelled == 0
    streamed = [r for r in res.records if r.stream]
    ttft = [r.ttft_s * 1e3 for r in streamed]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1e3 for r in streamed]
    itl = [g * 1e3 for r in streamed for g in r.itl_s]
    e2e = [r.e2e_s * 1e3 for r in res.records]
    for stats, samples in ((res.ttft_ms, ttft), (res.tpot_ms, tpot), (res.itl_ms, itl), (res.e2e_ms, e2e)):
        assert stats.count == len(samples)
        assert stats.mean == pytest.approx(statistics.mean(samples))
        assert stats.p50 == pytest.approx(statistics.median(samples))
        assert [stats.p50, stats.p90, stats.p99] == pytest.approx(list(np.percentile(samples, [50, 90, 99])))
    assert len(ttft) == 30 and len(itl) == 30 * 4
    # the server's sleep may end up to ~1 ms early by the client's clock: uvicorn's loop (uvloop: libuv) keeps a
    # millisecond time cached from the start of its iteration (CI once measured 29.905 ms for a 30 ms sleep)
    slack_s = 1e-3
    assert min(ttft) >= (FIRST_DELAY_S - slack_s) * 1e3
    assert min(itl) >= 0 and all(r.e2e_s >= r.ttft_s for r in streamed)
    assert all(r.ttft_s is None and r.e2e_s >= FIRST_DELAY_S - slack_s for r in res.records if not r.stream)


def test_concurrency_bound_is_respected(fake: FakeServer) -> None:
    res = _run(fake, PROMPTS, num_requests=48, concurrency=6, stream_fraction=0.5)
    assert res.completed == 48 and res.max_in_flight == 6
    assert 2 <= fake.max_in_flight <= 6 and fake.requests == 48


def test_tokens_from_usage_else_chunks(fake: FakeServer, client: str) -> None:
    fake.tokens_per_chunk = 2
    with_usage = _run(fake, PROMPTS, client=client, num_requests=8, max_tokens=6)
    fake.tokens_per_chunk = 2
    without = _run(fake, PROMPTS, client=client, num_requests=8, max_tokens=6, include_usage=False)
    assert {r.output_tokens for r in with_usage.records} == {6} and {r.chunks for r in with_usage.records} == {3}
    assert {r.output_tokens for r in without.records} == {3}
    r = with_usage.records[0]
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 5)


def test_chat_endpoint_skips_role_chunk_for_ttft(fake: FakeServer, client: str) -> None:
    res = _run(fake, PROMPTS, client=client, num_requests=12, endpoint="chat", stream_fraction=0.5, cancel_fraction=0.25)
    assert (res.completed, res.cancelled, res.failed) == (9, 3, 0)
    assert res.ttft_ms.count == 3 and res.ttft_ms.p50 >= FIRST_DELAY_S * 1e3
    assert all(r.output_tokens == 4 for r in res.records if r.status == bs.COMPLETED)


def test_poisson_arrivals(fake: FakeServer) -> None:
    res = _run(fake, PROMPTS, num_requests=15, concurrency=None, request_rate=200.0, seed=5)
    plans = bs.plan_requests(PROMPTS, 15, request_rate=200.0, seed=5)
    assert res.completed == 15 and plans[0].arrival_s == 0.0
    arrivals = [p.arrival_s for p in plans]
    assert arrivals == sorted(arrivals) and arrivals == [p.arrival_s for p in bs.plan_requests(
        PROMPTS, 15, request_rate=200.0, seed=5)]
    assert all(r.start_s >= p.arrival_s - 1e-3 for r, p in zip(res.records, plans))
    assert res.duration_s >= arrivals[-1]


def test_timeouts_and_connection_errors_fail_requests(fake: FakeServer, client: str) -> None:
    # 1 s leaves the quick requests (~50 ms at the fake) room on a loaded CI machine: 0.3 s once timed all four out
    res = _run(fake, ["SLOW one", "quick one"], client=client, num_requests=4, stream_fraction=0.5, timeout_s=1.0)
    assert res.completed + res.failed == 4 and res.failed == 2
    assert all("timed out after 1.0 s" in e for e in res.errors)
    assert _wait_for(lambda: fake.in_flight == 0), fake.in_flight  # the SLOW handlers saw their clients go
    t0 = time.monotonic()
    dead = asyncio.run(bs.run_load(f"http://127.0.0.1:{free_port()}", "m", PROMPTS, client=client, num_requests=3,
                                   max_tokens=2, concurrency=3, stream_fraction=0.5, timeout_s=5.0))
    assert dead.failed == 3 and all("Connect" in e for e in dead.errors)  # ConnectError, ClientConnectorError
    assert dead.ttft_ms.count == 0 and dead.ttft_ms.p50 is None and time.monotonic() - t0 < 5


def test_api_key_and_v1_base_url(fake: FakeServer, client: str) -> None:
    res = asyncio.run(bs.run_load(fake.base_url + "/v1/", "fake-model", PROMPTS, client=client, num_requests=3, max_tokens=2,
                                  api_key="sk-test", timeout_s=10.0))
    assert res.completed == 3 and fake.auth == ["Bearer sk-test"] * 3


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="cancel"):
        bs.plan_requests(PROMPTS, 10, stream_fraction=0.1, cancel_fraction=0.2)
    with pytest.raises(ValueError, match="fractions"):
        bs.plan_requests(PROMPTS, 10, stream_fraction=1.5)
    with pytest.raises(ValueError, match="endpoint"):
        asyncio.run(bs.run_load("http://127.0.0.1:1", "m", PROMPTS, num_requests=1, max_tokens=1, endpoint="x"))


# ----------------------------------------------------------------------------------------------- /metrics
def test_scrape_metrics(fake: FakeServer) -> None:
    summed = asyncio.run(bs.scrape_metrics(fake.base_url))
    assert summed["vllm:num_requests_running"] == 3.0
    assert summed["vllm:num_requests_waiting"] == 0.0
    assert summed["vllm:kv_cache_usage_perc"] == 0.25
    assert summed["vllm:prompt_tokens_total"] == 1500.0
    assert summed["odd_labels"] == 3.0 and summed["no_labels"] == 42.0
    assert np.isnan(summed["nan_gauge"])
    assert summed["vllm:e2e_request_latency_seconds_bucket"] == 7.0
    labelled = asyncio.run(bs.scrape_metrics(fake.base_url, keep_labels=True))
    assert labelled['vllm:num_requests_running{model_name="fake",engine="0"}'] == 2.0
    assert labelled['vllm:num_requests_running{model_name="fake",engine="1"}'] == 1.0
    assert labelled['odd_labels{path="a}b \\"q\\" c",x="y"}'] == 3.0
    assert not any(k.startswith("#") for k in labelled)


def test_parse_prometheus_text_rejects_malformed_lines() -> None:
    assert bs.parse_prometheus_text("a 1\na 2\n# TYPE a gauge\n") == {"a": 3.0}
    assert bs.parse_prometheus_text('b{x="1"} +Inf') == {"b": float("inf")}
    for bad in ("{x=1} 2", 'a{x="1" 2', "a", "a{} notanumber"):
        with pytest.raises(ValueError):
            bs.parse_prometheus_text(bad)


# ----------------------------------------------------------------------------------------------- CLI
def test_cli_writes_json_and_table(fake: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "load.json"
    rc = bs.main(["--base-url", fake.base_url, "--num-requests", "20", "--concurrency", "4", "--max-tokens", "3",
                  "--stream-fraction", "0.5", "--cancel-fraction", "0.1", "--metrics", "--records",
                  "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "cancelled 2" in printed and "vllm:num_requests_running" in printed
    data = json.loads(out.read_text())
    assert (data["submitted"], data["completed"], data["cancelled"], data["failed"]) == (20, 18, 2, 0)
    assert data["config"]["model"] == "fake-model"  # discovered through /v1/models
    assert data["server_metrics"]["vllm:num_requests_running"] == 3.0
    assert len(data["records"]) == 20 and "tpot_s" in data["records"][0]
    assert set(data["ttft_ms"]) == {"count", "mean", "p50", "p90", "p99"}

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nFAIL now\n\n")
    rc = bs.main(["--base-url", fake.base_url, "--model", "fake-model", "--num-requests", "4", "--max-tokens", "2",
                  "--prompts-file", str(prompts), "--fail-on-error"])
    assert rc == 1 and "failed 2" in capsys.readouterr().out
