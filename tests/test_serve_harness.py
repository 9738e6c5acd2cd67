"""tests/serve_harness.py against a stub server process (the real `graphrunner serve` is in test_serve_load.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from serve_harness import start_server

STUB = '''
import http.server, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
assert sys.argv[sys.argv.index("--host") + 1] == "127.0.0.1"
mode = os.environ["STUB_MODE"]
if mode == "exit":
    print("boom on stderr", file=sys.stderr)
    sys.exit(3)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" and mode != "never" else 503)
        self.end_headers()
        self.wfile.write(" ".join(sys.argv[1:]).encode())

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Handler)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else lambda *a: sys.exit(0))
print("stub listening", file=sys.stderr, flush=True)
server.serve_forever()
'''


@pytest.fixture
def stub(tmp_path: Path) -> list[str]:
    path = tmp_path / "stub_server.py"
    path.write_text(STUB)
    return [sys.executable, str(path)]


def test_start_poll_and_graceful_stop(stub: list[str], tmp_path: Path) -> None:
    server = start_server(["--extra", "arg"], {"STUB_MODE": "ok"}, timeout_s=30, log_dir=tmp_path, command=stub)
    try:
        resp = httpx.get(f"{server.base_url}/health", timeout=5, trust_env=False)
        assert resp.status_code == 200 and resp.text.endswith(f"--port {server.port} --extra arg")
        assert server.stderr_path.parent == tmp_path
    finally:
        rc = server.stop()
    assert rc == 0 and server.stop() == 0
    assert "stub listening" in server.log_tail()


def test_stop_kills_after_the_grace_period(stub: list[str], tmp_path: Path) -> None:
    server = start_server([], {"STUB_MODE": "stubborn"}, timeout_s=30, log_dir=tmp_path, command=stub)
    assert server.stop(timeout_s=0.5) == -9


def test_early_exit_raises_with_the_log(stub: list[str], tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*boom on stderr"):
        start_server([], {"STUB_MODE": "exit"}, timeout_s=30, log_dir=tmp_path, command=stub)


def test_no_health_within_the_timeout(stub: list[str], tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not answer GET /health within 1.0 s"):
        start_server([], {"STUB_MODE": "never"}, timeout_s=1.0, log_dir=tmp_path, command=stub)
