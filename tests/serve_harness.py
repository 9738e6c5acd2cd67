"""Test helpers (not a test module): run a real `graphrunner serve` process, and load tools/bench_serve.py.

    server = start_server(["--max-num-seqs", "64"], env={})   # waits until GET /health answers 200
    try:
        ...  # talk to server.base_url
    finally:
        rc = server.stop()                                     # SIGTERM, bounded wait, then SIGKILL

The server's stdout and stderr go to `server.stderr_path`
(a temporary file, kept for diagnostics); `server.log_tail()` reads its end. The process runs in its own
session, so a forced stop kills the process group it started and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import IO

import httpx
from tool_loader import load_tool

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server may still lose a race for it: start_server retries)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def load_bench_serve() -> ModuleType:
    """tools/bench_serve.py as the module `bench_serve` (tools/ is not a package; its sibling modules, such as
    bench_http, are found through tools/ on sys.path, as when the tool runs)."""
    return load_tool("bench_serve")


class ServerProcess:
    """A running `graphrunner serve` on 127.0.0.1:`port`."""

    def __init__(self, proc: subprocess.Popen, port: int, stderr_path: Path, log: IO[bytes]) -> None:
        self.proc, self.port, self.stderr_path, self._log = proc, port, stderr_path, log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, max_chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.stderr_path.read_text(encoding="utf-8", errors="replace")
        return text[-max_chars:]

    def stop(self, graceful: bool = True, timeout_s: float = 30.0) -> int:
        """Stop the server and return its exit code (negative: killed by that signal).

        graceful: SIGTERM, then wait up to timeout_s, then SIGKILL to its process group; else SIGKILL at once.
        Calling it again returns the same code.
        """
        if self.proc.poll() is None and graceful:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
            except ProcessLookupError:
                pass
            self.proc.wait(timeout_s)
        else:
            _kill_leftovers(self.proc.pid)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def _kill_leftovers(pgid: int) -> None:
    """After the leader exited: SIGKILL whatever of its process group is still there (workers it forked)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(command: list[str], args: list[str], env: dict[str, str], port: int, log_dir: Path | None) -> ServerProcess:
    fd, name = tempfile.mkstemp(prefix=f"graphrunner-serve-{port}-", suffix=".log", dir=log_dir)
    log = os.fdopen(fd, "wb")
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": pythonpath, **env}
    cmd = [*command, "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=full_env, cwd=REPO_ROOT,
                            start_new_session=True)
    return ServerProcess(proc, port, Path(name), log)


def _wait_healthy(server: ServerProcess, timeout_s: float) -> bool:
    """True once GET /health answers 200; False if the process exits first. Raises TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while server.proc.poll() is None:
            try:
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server.stop(graceful=False)
                raise TimeoutError(f"graphrunner serve did not answer GET /health within {timeout_s} s; "
                                   f"log {server.stderr_path}:\n{server.log_tail()}")
            time.sleep(0.25)
    return False


def start_server(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 180.0, *,
                 log_dir: Path | None = None, attempts: int = 3, command: list[str] | None = None) -> ServerProcess:
    """Run `python -m graphrunner serve --host 127.0.0.1 --port <free port> *args` and wait for /health.

    env is merged over os.environ (PYTHONPATH gets the repository root in front). If the process exits
    before it is healthy because its port was taken meanwhile, it is retried on another port (`attempts`
    in all); any other early exit raises RuntimeError with the end of its log, and no answer within timeout_s
    raises TimeoutError (the process killed). log_dir: where the log file goes (default: the temp dir).
    command: what runs instead of `python -m graphrunner serve` (the harness's own tests use a stub).
    """
    command = list(command or [sys.executable, "-m", "graphrunner", "serve"])
    for _ in range(attempts):
        server = _spawn(command, list(args), dict(env or {}), free_port(), log_dir)
        if _wait_healthy(server, timeout_s):
            return server
        rc, tail = server.stop(graceful=False), server.log_tail()
        if "address already in use" not in tail.lower():
            break
    raise RuntimeError(f"graphrunner serve exited with {rc} before it was healthy; log {server.stderr_path}:"
                       f"\n{tail}")
