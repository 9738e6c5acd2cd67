"""graphrunner.proc_exit: a child's exit is seen from /proc before it is reaped (the TP watcher relies on it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from graphrunner.proc_exit import PF_EXITING, exit_code_if_exiting, parse_stat

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _until(pid: int, want: int | None, timeout_s: float = 10.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    code = exit_code_if_exiting(pid)
    while code != want and time.monotonic() < deadline:
        time.sleep(0.01)
        code = exit_code_if_exiting(pid)
    return code


def test_a_running_child_is_not_exiting() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.1)
        assert exit_code_if_exiting(child.pid) is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(("argv", "code"), [
    (None, -signal.SIGKILL),
    ([sys.executable, "-c", "import sys; sys.exit(3)"], 3),
    ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], -signal.SIGTERM),
])
def test_an_exited_child_shows_its_code_before_it_is_reaped(argv: list[str] | None, code: int) -> None:
    child = subprocess.Popen(argv or [sys.executable, "-c", "import time; time.sleep(30)"])
    if argv is None:
        os.kill(child.pid, signal.SIGKILL)
    assert _until(child.pid, code) == code  # a zombie: not waited for yet
    assert child.wait() == code  # the same code as waitpid's


def test_a_missing_process_is_not_reported() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert exit_code_if_exiting(child.pid) is None  # reaped: /proc has nothing (the caller's waitpid knows)


def test_parse_stat_reads_past_a_command_name_with_spaces_and_parentheses() -> None:
    rest = ["0"] * 42
    line = f"12 (a b) c)) D 1 2 3 4 5 {PF_EXITING | 0x400000} " + " ".join(rest) + " 9\n"
    assert parse_stat(line) == ("D", PF_EXITING | 0x400000, 9)
    assert parse_stat("7 (x) R 1 2 3 4 5 0 0 0")[:2] == ("R", 0)  # a kernel without field 52: exit code 0
