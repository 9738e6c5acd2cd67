"""`graphrunner serve` end to end: a real server subprocess on 127.0.0.1 driven with the official openai client
and httpx (completions, chat, streaming, logprobs, seeds, stops, usage, errors, auth, 429, metrics, SIGTERM).
Every wait is bounded; generations stay short (the demo model on CPU)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
MODEL = "demo"
PROMPT = "Once upon a time"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAPHRUNNER_DEVICE": "cpu"}
        cmd = [sys.executable, "-m", "graphrunner", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", KEY, "--served-model-name", MODEL, "--max-num-seqs", "8", "--log-level", "warning",
               *extra]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stdout.read().decode()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError("server did not become healthy within 120 s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def post(self, path: str, body: object, key: str | None = KEY, **kw: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _greedy(client: openai.OpenAI, **kw: object) -> object:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, **kw)


def test_completion_stream_equals_plain(client: openai.OpenAI) -> None:
    plain = _greedy(client)
    assert plain.choices[0].text and plain.choices[0].finish_reason == "length"
    chunks = list(_greedy(client, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_chat_stream_equals_plain(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Tell me a story"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    text = plain.choices[0].message.content
    assert text and plain.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_and_batch(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, max_tokens=4, temperature=0.8)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16


def test_logprobs(client: openai.OpenAI) -> None:
    lp = _greedy(client, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 12
    assert all(len(t) >= 1 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_seed_reproducible(client: openai.OpenAI) -> None:
    texts = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=1234)
             .choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


def test_stop_string(client: openai.OpenAI) -> None:
    text = _greedy(client).choices[0].text
    stop = text.strip().split()[1]
    cut = text[:text.index(stop, len(text) - len(text.lstrip()) + 1)]
    out = _greedy(client, stop=[stop]).choices[0]
    assert out.text == cut and out.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in _greedy(client, stop=[stop], stream=True) if c.choices)
    assert streamed == cut


def test_usage_matches_tokenize(server: Server, client: openai.OpenAI) -> None:
    count = server.post("/tokenize", {"model": MODEL, "prompt": PROMPT}).json()["count"]
    usage = _greedy(client).usage
    assert usage.prompt_tokens == count and usage.completion_tokens == 12 and usage.total_tokens == count + 12


def test_extra_body_and_token_prompt(server: Server, client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.7,
                                    extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                                "min_tokens": 2, "ignore_eos": True})
    assert out.usage.completion_tokens == 4
    ids = server.post("/tokenize", {"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == _greedy(client).choices[0].text


def test_401_without_key(server: Server) -> None:
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        responses = [httpx.get(server.url + "/v1/models", headers=headers, timeout=30),
                     server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key=key),
                     server.post("/v1/chat/completions", {"model": MODEL, "messages": []}, key=key)]
        for r in responses:
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("extra", [
    {"temperature": -1}, {"top_p": 2}, {"n": 0}, {"max_tokens": 0}, {"logprobs": 50}, {"temperature": "hot"},
    {"max_tokens": "many"}, {"stop": 3}, {"prompt": "word " * 2000}, {"prompt": [[]]}, {"logit_bias": {"x": 1}},
])
def test_400_bad_parameters(server: Server, extra: dict) -> None:
    r = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["message"] and "param" in err
    if "prompt" in extra and isinstance(extra["prompt"], str):
        assert "1024" in err["message"] and "tokens" in err["message"]


def test_400_malformed_and_chat(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": ', timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                             "logprobs": True, "top_logprobs": 50, "max_tokens": 2})
    assert r.status_code == 400


def test_404_unknown_model(server: Server) -> None:
    r = server.post("/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_tokenize_detokenize_version_metrics(server: Server, client: openai.OpenAI) -> None:
    tokens = server.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert server.post("/detokenize", {"tokens": tokens}).json()["prompt"] == PROMPT
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]
    _greedy(client)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert name in text
    assert f'model_name="{MODEL}"' in text


def test_disconnect_aborts_stream(server: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        if 'finished_reason="abort"' in text and "vllm:num_requests_running{" in text:
            running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running{")]
            if running and float(running[0].split()[-1]) == 0:
                return
        time.sleep(0.5)
    pytest.fail("the abandoned stream was not aborted")


def test_429_then_graceful_sigterm() -> None:
    srv = Server("--max-waiting-requests", "1", "--max-num-seqs", "1")
    try:
        codes: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}
        threads = [threading.Thread(target=lambda: codes.append(srv.post("/v1/completions", body)))
                   for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        statuses = sorted(r.status_code for r in codes)
        assert 200 in statuses and 429 in statuses, statuses
        limited = next(r for r in codes if r.status_code == 429)
        assert limited.headers.get("retry-after") and limited.json()["error"]["code"] == 429
        started, lines = threading.Event(), []

        def stream() -> None:  # in flight while SIGTERM arrives: it finishes (or is aborted), never hangs
            body_ = {**body, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body_, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    started.set()
                    lines.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        reader.join(30)
        assert not reader.is_alive() and "data: [DONE]" in lines
    finally:
        srv.kill()
