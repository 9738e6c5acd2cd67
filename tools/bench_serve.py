"""Load generator for an OpenAI-compatible HTTP server (`graphrunner serve`, vLLM, ...), over the HTTP API only.

Sends `num_requests` requests to `/v1/completions` (or `/v1/chat/completions`), either at a fixed concurrency
(at most N requests in flight) or as a Poisson process of `request_rate` requests/s (optionally also capped by
a concurrency), a chosen fraction of them streamed (SSE) and a chosen fraction of the streamed ones cancelled:
the client closes the stream after the k-th content chunk. Both choices are deterministic functions of `seed`:
exactly round(fraction * num_requests) requests are picked with `random.Random(seed)`.

Per request it measures, with `time.perf_counter` from just before the request is sent:
  * TTFT: time to the first *content* chunk (a chunk whose choices carry non-empty `text`, or `delta.content`
    for chat; role-only and usage-only chunks do not count), streamed requests only;
  * ITL: the gaps between consecutive content chunks;
  * e2e: time to `data: [DONE]` (streamed) or to the full response body (not streamed);
  * output tokens: `usage.completion_tokens` (asked for with `stream_options={"include_usage": true}` when
    streaming), else the number of content chunks; TPOT = (e2e - TTFT) / (output tokens - 1).
Statistics (mean, p50, p90, p99 in ms; numpy's linear-interpolation percentiles) are over *completed* requests
only, like vLLM's benchmark_serving: TTFT and ITL over completed streamed requests, TPOT over those with at
least 2 output tokens, e2e over all completed requests. Throughputs divide completed requests and their output
tokens by the run's wall time. A request ends as exactly one of completed, cancelled (closed by us as planned)
or failed (HTTP status != 200, an error event in the stream, a stream that ends without `[DONE]`, a malformed
body, a connection error, or the per-request `timeout_s`); the first MAX_ERRORS error messages are kept.

`scrape_metrics` reads `/metrics` (Prometheus text) into {name: value}, summing a metric's label sets
(e.g. `vllm:num_requests_running` over `model_name`s); `keep_labels=True` keys by `name{labels}` instead.

The HTTP client is aiohttp when it is installed (what vLLM's benchmark_serving uses; `client="httpx"` picks httpx):
httpx spends ~1-3 ms more of the client's own time per request, which a TTFT measurement would otherwise
charge to the server. Only the given base URL is ever contacted (proxy environment variables are ignored).
Example:

    python tools/bench_serve.py --base-url http://127.0.0.1:8000 --num-requests 1000 --concurrency 64 \\
        --max-tokens 8 --stream-fraction 0.5 --cancel-fraction 0.1 --metrics --json /tmp/load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from bench_http import (  # noqa: F401 -- re-exported: the tests and bench_sv1 reach them through bench_serve
    ServerError,
    _Reply,
    discover_model,
    make_client,
    make_transport,
    parse_prometheus_text,
    resolve_client,
    scrape_metrics,
    sse_data,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETED, CANCELLED, FAILED = "completed", "cancelled", "failed"
MAX_ERRORS = 10  # error messages kept in LoadResult.errors
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SERVER_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


# ----------------------------------------------------------------------------------------------- records
@dataclass
class RequestPlan:
    index: int
    prompt: str | list[int]
    stream: bool
    cancel_after: int | None  # close the stream after this many content chunks; None: read it to the end
    arrival_s: float | None  # Poisson mode: when to send, in seconds from the run's start; None: at once


@dataclass
class RequestRecord:
    """What one request did; times in seconds, `start_s` from the run's start, the others from `start_s`."""

    index: int
    stream: bool
    status: str = FAILED
    error: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0  # content chunks received

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Stats:
    """Summary of samples in milliseconds; the fields are None when there are no samples."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, samples_ms: list[float]) -> Stats:
        if not samples_ms:
            return cls(0, None, None, None, None)
        p50, p90, p99 = (float(x) for x in np.percentile(samples_ms, [50, 90, 99]))
        return cls(len(samples_ms), statistics.fmean(samples_ms), p50, p90, p99)


@dataclass
class LoadResult:
    submitted: int
    completed: int
    cancelled: int
    failed: int
    errors: list[str]  # the first MAX_ERRORS messages of failed requests, "request <i>: <message>"
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_output_tokens: int  # of completed requests
    max_in_flight: int  # most requests in flight at once, seen by the client
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    config: dict[str, Any] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if include_records:
            for rec, obj in zip(out["records"], self.records):
                rec["tpot_s"] = obj.tpot_s
        else:
            del out["records"]
        return out

    def table(self) -> str:
        lines = [(f"{'requests':<22} submitted {self.submitted}, completed {self.completed}, "
                  f"cancelled {self.cancelled}, failed {self.failed}"),
                 f"{'duration':<22} {self.duration_s:.3f} s (max in flight {self.max_in_flight})",
                 f"{'request throughput':<22} {self.request_throughput:.2f} req/s",
                 f"{'output throughput':<22} {self.output_throughput:.2f} tok/s ({self.total_output_tokens} tokens)",
                 f"{'(ms)':<10}{'count':>8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            st: Stats = getattr(self, name)
            cells = "".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in (st.mean, st.p50, st.p90, st.p99))
            lines.append(f"{name.removesuffix('_ms').upper():<10}{st.count:>8}{cells}")
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)




# ----------------------------------------------------------------------------------------------- planning
def poisson_arrivals(num: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of a Poisson process of `rate` requests/s; the first is at 0."""
    times, t = [], 0.0
    for i in range(num):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def plan_requests(prompts: list[str] | list[list[int]], num_requests: int, *, stream_fraction: float = 1.0,
                  cancel_fraction: float = 0.0, cancel_after: int = 1, request_rate: float | None = None,
                  seed: int = 0) -> list[RequestPlan]:
    """Request i uses prompts[i % len(prompts)]; round(fraction * num_requests) of them stream / are cancelled."""
    if not prompts:
        raise ValueError("no prompts")
    if num_requests < 1 or cancel_after < 1:
        raise ValueError(f"num_requests ({num_requests}) and cancel_after ({cancel_after}) must be >= 1")
    if not (0.0 <= stream_fraction <= 1.0 and 0.0 <= cancel_fraction <= 1.0):
        raise ValueError(f"fractions must be in [0, 1]: stream {stream_fraction}, cancel {cancel_fraction}")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    n_stream, n_cancel = round(stream_fraction * num_requests), round(cancel_fraction * num_requests)
    if n_cancel > n_stream:
        raise ValueError(f"cannot cancel {n_cancel} requests: only {n_stream} stream (cancel_fraction > "
                         f"stream_fraction)")
    rng = random.Random(seed)
    streamed = set(rng.sample(range(num_requests), n_stream))
    cancelled = set(rng.sample(sorted(streamed), n_cancel))
    arrivals = poisson_arrivals(num_requests, request_rate, rng) if request_rate else [None] * num_requests
    return [RequestPlan(i, prompts[i % len(prompts)], i in streamed, cancel_after if i in cancelled else None,
                        arrivals[i]) for i in range(num_requests)]


def default_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` short, varied English prompts (deterministic in `seed`)."""
    rng = random.Random(seed)
    openers = ["Tell me about", "Write a line on", "Once upon a time", "The meaning of", "A short note on",
               "Describe", "What is", "Consider", "In the beginning", "My dear"]
    topics = ["the sea", "a castle", "the king", "pride", "a letter", "the weather", "old books", "the garden",
              "a stranger", "the war", "a ball", "the moon", "hackers", "the law", "a dinner"]
    return [f"{rng.choice(openers)} {rng.choice(topics)} {i}" for i in range(num)]


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


# ----------------------------------------------------------------------------------------------- sending
@dataclass
class _Sender:
    client: Any  # a transport (make_transport)
    model: str
    endpoint: str
    max_tokens: int
    include_usage: bool
    extra_body: dict[str, Any]
    timeout_s: float
    t0: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0

    def payload(self, plan: RequestPlan) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "stream": plan.stream}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": plan.prompt}]
        else:
            body["prompt"] = plan.prompt
        if plan.stream and self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return {**body, **self.extra_body}

    async def send(self, plan: RequestPlan) -> RequestRecord:
        """Run one request to its end, bounded by `timeout_s`; never raises (errors make it FAILED)."""
        rec = RequestRecord(plan.index, plan.stream)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = time.perf_counter()
        rec.start_s = start - self.t0
        try:
            coro = self._stream(plan, rec, start) if plan.stream else self._plain(plan, rec, start)
            await asyncio.wait_for(coro, self.timeout_s)
        except asyncio.TimeoutError:
            rec.status, rec.error = FAILED, f"timed out after {self.timeout_s} s"
        except Exception as e:  # noqa: BLE001 - any per-request problem is a failed request, not a crashed run
            rec.status, rec.error = FAILED, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        finally:
            self.in_flight -= 1
        return rec

    async def _plain(self, plan: RequestPlan, rec: RequestRecord, start: float) -> None:
        async with self.client.post(ENDPOINTS[self.endpoint], self.payload(plan)) as resp:
            text = await resp.read_text()
        if resp.status != 200:
            raise ServerError(f"HTTP {resp.status}: {text[:300]}")
        body = json.loads(text)
        rec.e2e_s = time.perf_counter() - start
        rec.output_tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
        rec.status = COMPLETED

    async def _stream(self, plan: RequestPlan, rec: RequestRecord, start: float) -> None:
        async with self.client.post(ENDPOINTS[self.endpoint], self.payload(plan)) as resp:
            if resp.status != 200:
                raise ServerError(f"HTTP {resp.status}: {(await resp.read_text())[:300]}")
            done, usage_tokens = await self._read_events(resp, plan, rec, start)
        if rec.status == CANCELLED:  # closed by us: the body was not read to its end
            rec.output_tokens = rec.chunks
            return
        if not done:
            raise ServerError(f"stream ended without data: [DONE] after {rec.chunks} content chunks")
        rec.output_tokens = rec.chunks if usage_tokens is None else usage_tokens
        rec.status = COMPLETED

    async def _read_events(self, resp: _Reply, plan: RequestPlan, rec: RequestRecord,
                           start: float) -> tuple[bool, int | None]:
        """Read the stream up to [DONE] (sets e2e_s) or the planned cancel; returns ([DONE] seen, usage tokens)."""
        usage_tokens, last = None, start
        async for data in sse_data(resp):
            now = time.perf_counter()
            if data.strip() == "[DONE]":
                rec.e2e_s = now - start
                return True, usage_tokens
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"error event in the stream: {json.dumps(chunk['error'])[:300]}")
            if chunk.get("usage"):
                usage_tokens = int(chunk["usage"].get("completion_tokens") or 0)
            if not _has_content(chunk):
                continue
            if rec.ttft_s is None:
                rec.ttft_s = now - start
            else:
                rec.itl_s.append(now - last)
            last, rec.chunks = now, rec.chunks + 1
            if plan.cancel_after is not None and rec.chunks >= plan.cancel_after:
                rec.status, rec.e2e_s = CANCELLED, now - start
                return False, usage_tokens
        return False, usage_tokens


# ----------------------------------------------------------------------------------------------- the run
async def _dispatch(sender: _Sender, plans: list[RequestPlan], concurrency: int | None) -> list[RequestRecord]:
    """Send every plan: at its Poisson arrival time if it has one, and never more than `concurrency` at once."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(plan: RequestPlan) -> RequestRecord:
        if plan.arrival_s is not None:
            await asyncio.sleep(max(0.0, sender.t0 + plan.arrival_s - time.perf_counter()))
        if sem is None:
            return await sender.send(plan)
        async with sem:
            return await sender.send(plan)

    return list(await asyncio.gather(*(one(p) for p in plans)))


def summarize(records: list[RequestRecord], duration_s: float, max_in_flight: int = 0,
              config: dict[str, Any] | None = None) -> LoadResult:
    """Counts, throughputs and statistics of finished requests (see the module docstring for which samples)."""
    done = [r for r in records if r.status == COMPLETED]
    streamed = [r for r in done if r.stream and r.ttft_s is not None]
    failed = [r for r in records if r.status == FAILED]
    tokens = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return LoadResult(
        submitted=len(records), completed=len(done), cancelled=sum(r.status == CANCELLED for r in records),
        failed=len(failed), errors=[f"request {r.index}: {r.error}" for r in failed[:MAX_ERRORS]],
        duration_s=duration_s, request_throughput=len(done) * per_s, output_throughput=tokens * per_s,
        total_output_tokens=tokens, max_in_flight=max_in_flight,
        ttft_ms=Stats.of([r.ttft_s * 1e3 for r in streamed]),
        tpot_ms=Stats.of([r.tpot_s * 1e3 for r in streamed if r.tpot_s is not None]),
        itl_ms=Stats.of([x * 1e3 for r in streamed for x in r.itl_s]),
        e2e_ms=Stats.of([r.e2e_s * 1e3 for r in done if r.e2e_s is not None]),
        config=dict(config or {}), records=records)


async def run_load(base_url: str, model: str, prompts: list[str] | list[list[int]], *, num_requests: int,
                   max_tokens: int, concurrency: int | None = None, request_rate: float | None = None,
                   endpoint: str = "completions", stream_fraction: float = 1.0, cancel_fraction: float = 0.0,
                   cancel_after: int = 1, include_usage: bool = True, extra_body: dict[str, Any] | None = None,
                   api_key: str | None = None, timeout_s: float = 60.0, seed: int = 0,
                   client: str = "auto") -> LoadResult:
    """Send `num_requests` requests to `base_url` and measure them (see the module docstring).

    concurrency: at most this many requests in flight (None: no cap); request_rate: Poisson arrivals at this
    many requests/s (None: send as soon as the concurrency allows; with neither, all at once). endpoint:
    "completions" or "chat". cancel_after: a cancelled request closes its stream after this many content
    chunks (it completes normally if the server finishes first). extra_body: merged into every request body
    (e.g. {"temperature": 0, "ignore_eos": True}). timeout_s bounds each request from send to its last byte.
    client: "auto" (aiohttp when installed), "aiohttp" or "httpx".
    """
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    plans = plan_requests(prompts, num_requests, stream_fraction=stream_fraction, cancel_fraction=cancel_fraction,
                          cancel_after=cancel_after, request_rate=request_rate, seed=seed)
    config = {"base_url": base_url, "model": model, "endpoint": endpoint, "num_requests": num_requests,
              "max_tokens": max_tokens, "concurrency": concurrency, "request_rate": request_rate,
              "stream_fraction": stream_fraction, "cancel_fraction": cancel_fraction, "cancel_after": cancel_after,
              "include_usage": include_usage, "extra_body": extra_body or {}, "timeout_s": timeout_s, "seed": seed,
              "client": resolve_client(client)}
    async with make_transport(client, base_url, api_key=api_key, timeout_s=timeout_s,
                              max_connections=concurrency) as transport:
        sender = _Sender(transport, model, endpoint, max_tokens, include_usage, dict(extra_body or {}), timeout_s)
        sender.t0 = time.perf_counter()
        records = await _dispatch(sender, plans, concurrency)
        duration = time.perf_counter() - sender.t0
    return summarize(records, duration, sender.max_in_flight, config)


# ----------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server origin (default %(default)s)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: no cap)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests/s (default: none)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream-fraction", type=float, default=1.0)
    p.add_argument("--cancel-fraction", type=float, default=0.0, help="of all requests; they must be streamed")
    p.add_argument("--cancel-after", type=int, default=1, help="content chunks read before cancelling")
    p.add_argument("--no-usage", action="store_true", help="do not ask for usage: count tokens as chunks")
    p.add_argument("--extra-body", type=json.loads, default=None, help='JSON merged into bodies, e.g. \'{"ignore_eos": true}\'')
    p.add_argument("--prompts-file", default=None, help="one prompt a line (default: generated short prompts)")
    p.add_argument("--random-token-prompts", default=None, metavar="MIN,MAX",
                   help="token-id prompts of lengths uniform in [MIN, MAX], ids uniform in [0, 10000) (random.seed(0):"
                        " T1's prompts for MIN,MAX = 100,1024)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=60.0, help="per-request limit, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client", choices=("auto", "aiohttp", "httpx"), default="auto",
                   help="HTTP client library (auto: aiohttp when installed, as vLLM's benchmark)")
    p.add_argument("--metrics", action="store_true", help=f"scrape /metrics after the run and print {SERVER_GAUGES}")
    p.add_argument("--json", default=None, help="write the result here as JSON")
    p.add_argument("--records", action="store_true", help="include per-request records in the JSON")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 if any request failed")
    return p


def random_token_prompts(num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """The benchmarks' token-id prompts (tools/bench_common.random_prompts, without importing torch)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(10000) for _ in range(length)])
    return prompts


def _load_prompts(args: argparse.Namespace) -> list[str] | list[list[int]]:
    if args.random_token_prompts:
        lo, hi = (int(x) for x in args.random_token_prompts.split(","))
        return random_token_prompts(args.num_requests, lo, hi)
    if not args.prompts_file:
        return default_prompts(min(args.num_requests, 1000), args.seed)
    with open(args.prompts_file, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


async def _amain(args: argparse.Namespace, prompts: list[str] | list[list[int]]) -> tuple[LoadResult, dict[str, float] | None]:
    model = args.model or await discover_model(args.base_url, api_key=args.api_key, timeout_s=args.timeout)
    result = await run_load(
        args.base_url, model, prompts, num_requests=args.num_requests, max_tokens=args.max_tokens,
        concurrency=args.concurrency, request_rate=args.request_rate, endpoint=args.endpoint,
        stream_fraction=args.stream_fraction, cancel_fraction=args.cancel_fraction, cancel_after=args.cancel_after,
        include_usage=not args.no_usage, extra_body=args.extra_body, api_key=args.api_key,
        timeout_s=args.timeout, seed=args.seed, client=args.client)
    metrics = None
    if args.metrics:
        metrics = await scrape_metrics(args.base_url, api_key=args.api_key, timeout_s=min(args.timeout, 30.0))
    return result, metrics


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result, metrics = asyncio.run(_amain(args, _load_prompts(args)))
    print(result.table())
    if metrics is not None:
        for name in SERVER_GAUGES:
            print(f"{name:<30} {metrics.get(name, float('nan'))}")
    if args.json:
        out = result.to_dict(include_records=args.records)
        if metrics is not None:
            out["server_metrics"] = metrics
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 1 if args.fail_on_error and result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
