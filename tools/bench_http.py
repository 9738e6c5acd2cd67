"""HTTP for the load tools (bench_serve, bench_sv1): an httpx or aiohttp transport bound to one base URL (proxy
environment variables ignored), server-sent events read from either, and /metrics scraped into numbers.

aiohttp is what vLLM's benchmark_serving uses; httpx spends ~1-3 ms more of the client's own time per request, which a
TTFT measurement would otherwise charge to the server (`resolve_client("auto")` prefers aiohttp when installed).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Self

import httpx

try:
    import aiohttp
except ImportError:  # optional: httpx serves the same requests
    aiohttp = None


class ServerError(Exception):
    """The server answered, but not with a usable result (HTTP status, error event, truncated stream)."""


# ----------------------------------------------------------------------------------------------- HTTP
def _origin(base_url: str) -> str:
    """The server's origin: a trailing "/" or "/v1" is dropped (paths are /v1/..., /metrics, /health)."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def make_client(base_url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                max_connections: int | None = None) -> httpx.AsyncClient:
    """An httpx client bound to `base_url` only (trust_env=False: no proxies from the environment)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(base_url=_origin(base_url), headers=headers, timeout=httpx.Timeout(timeout_s),
                             limits=limits, trust_env=False)


def resolve_client(client: str) -> str:
    """"auto" -> "aiohttp" when installed, else "httpx"; anything else must be one of the two (and installed)."""
    if client == "auto":
        return "aiohttp" if aiohttp is not None else "httpx"
    if client not in ("aiohttp", "httpx"):
        raise ValueError(f"client must be auto, aiohttp or httpx, got {client!r}")
    if client == "aiohttp" and aiohttp is None:
        raise ValueError("client='aiohttp' but aiohttp is not installed")
    return client


@dataclass
class _Reply:
    """A response as the sender reads it, whichever library made it."""

    status: int
    lines: Any  # async iterator of the body's lines (str, no line ending)
    read_text: Any  # coroutine function: the whole (rest of the) body as text


class _ReplyContext:
    """`async with transport.post(path, body) as reply`: the library's own context manager, its response adapted."""

    def __init__(self, cm: Any, adapt: Any) -> None:
        self._cm, self._adapt = cm, adapt

    async def __aenter__(self) -> _Reply:
        return self._adapt(await self._cm.__aenter__())

    async def __aexit__(self, *exc: object) -> None:
        await self._cm.__aexit__(*exc)


def _from_httpx(resp: httpx.Response) -> _Reply:
    async def text() -> str:
        await resp.aread()
        return resp.text
    return _Reply(resp.status_code, resp.aiter_lines(), text)


def _from_aiohttp(resp: Any) -> _Reply:
    async def lines() -> Any:
        async for raw in resp.content:  # (aiohttp's StreamReader iterates lines)
            yield raw.decode("utf-8").rstrip("\r\n")
    return _Reply(resp.status, lines(), resp.text)


class _HttpxTransport:
    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float, max_connections: int | None) -> None:
        self._client = make_client(base_url, timeout_s=timeout_s, max_connections=max_connections)
        self._client.headers.update(headers)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    def post(self, path: str, body: dict[str, Any]) -> _ReplyContext:
        return _ReplyContext(self._client.stream("POST", path, json=body), _from_httpx)


class _AiohttpTransport:
    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float, max_connections: int | None) -> None:
        self._args = (_origin(base_url), headers, timeout_s, max_connections)
        self._session: Any = None

    async def __aenter__(self) -> Self:
        origin, headers, timeout_s, max_connections = self._args
        self._session = aiohttp.ClientSession(
            base_url=origin, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s), trust_env=False,
            connector=aiohttp.TCPConnector(limit=max_connections or 0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    def post(self, path: str, body: dict[str, Any]) -> _ReplyContext:
        return _ReplyContext(self._session.post(path, json=body), _from_aiohttp)


def make_transport(client: str, base_url: str, *, api_key: str | None, timeout_s: float,
                   max_connections: int | None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    kind = _AiohttpTransport if resolve_client(client) == "aiohttp" else _HttpxTransport
    return kind(base_url, headers, timeout_s, max_connections)


async def sse_data(response: Any):
    """Yield the `data` of each server-sent event (multi-line data joined by newlines; comments ignored) of an
    httpx response or a _Reply."""
    lines: list[str] = []
    source = response.lines if isinstance(response, _Reply) else response.aiter_lines()
    async for line in source:
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
    if lines:
        yield "\n".join(lines)


async def discover_model(base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The id of the first model listed by GET /v1/models."""
    async with make_client(base_url, api_key=api_key, timeout_s=timeout_s) as client:
        resp = await asyncio.wait_for(client.get("/v1/models"), timeout_s)
        resp.raise_for_status()
        models = resp.json().get("data") or []
    if not models:
        raise ServerError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


# ----------------------------------------------------------------------------------------------- /metrics
_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _split_sample(line: str) -> tuple[str, str, str]:
    """`name{labels} value [timestamp]` -> (name, "{labels}" or "", "value [timestamp]")."""
    m = _SAMPLE_NAME.match(line)
    if not m:
        raise ValueError(f"not a Prometheus sample line: {line!r}")
    name, i = m.group(0), m.end()
    if i < len(line) and line[i] == "{":
        quoted, escaped, j = False, False, i + 1
        while j < len(line) and (quoted or line[j] != "}"):
            escaped, quoted = (False, quoted) if escaped else (line[j] == "\\", quoted ^ (line[j] == '"'))
            j += 1
        if j == len(line):
            raise ValueError(f"unterminated labels in Prometheus line: {line!r}")
        return name, line[i:j + 1], line[j + 1:].strip()
    return name, "", line[i:].strip()


def parse_prometheus_text(text: str, *, keep_labels: bool = False) -> dict[str, float]:
    """Samples of a Prometheus text exposition; comments (# HELP, # TYPE) and blank lines are skipped.

    keep_labels=False: {name: sum of its samples over all label sets} (right for counters and gauges; for a
    histogram, `_sum` and `_count` sum fine but `_bucket` sums over `le` are meaningless: use keep_labels).
    keep_labels=True: {name + labels exactly as served, e.g. 'x{model_name="m"}': value}.
    """
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, labels, rest = _split_sample(line)
        if not rest:
            raise ValueError(f"no value in Prometheus line: {line!r}")
        value = float(rest.split()[0])
        key = name + labels if keep_labels else name
        out[key] = out.get(key, 0.0) + value
    return out


async def scrape_metrics(base_url: str, *, keep_labels: bool = False, api_key: str | None = None,
                         timeout_s: float = 10.0) -> dict[str, float]:
    """GET `base_url`/metrics and parse it with parse_prometheus_text (bounded by timeout_s)."""
    async with make_client(base_url, api_key=api_key, timeout_s=timeout_s) as client:
        resp = await asyncio.wait_for(client.get("/metrics"), timeout_s)
    if resp.status_code != 200:
        raise ServerError(f"GET /metrics: HTTP {resp.status_code}: {resp.text[:300]}")
    return parse_prometheus_text(resp.text, keep_labels=keep_labels)
