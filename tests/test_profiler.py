"""graphrunner.profiler: a CPU torch.profiler session around a matmul writes a Chrome trace; misuse is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphrunner.profiler import PROFILER_DIR_ENV_VARS, Profiler, resolve_profiler_dir


@pytest.fixture(autouse=True)
def _no_profiler_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in PROFILER_DIR_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def _work() -> None:
    a = torch.randn(64, 64)
    (a @ a).sum().item()


def _load_trace(path: Path) -> dict:
    trace = json.loads(path.read_text())
    assert isinstance(trace, dict) and "traceEvents" in trace
    return trace


def test_start_stop_writes_chrome_trace(tmp_path: Path) -> None:
    out_dir = tmp_path / "nested" / "traces"  # created on demand
    prof = Profiler()
    prof.start(out_dir)
    assert prof.is_running
    _work()
    path = prof.stop()
    assert not prof.is_running
    assert path.parent == out_dir and path.suffix == ".json" and path.is_file()
    names = {e.get("name", "") for e in _load_trace(path)["traceEvents"]}
    assert any("matmul" in n or "mm" in n for n in names), sorted(names)[:20]
    # a second session in the same directory gets its own file
    prof.start(out_dir)
    _work()
    second = prof.stop()
    assert second != path and _load_trace(second)


@pytest.mark.parametrize("var", PROFILER_DIR_ENV_VARS)
def test_directory_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, str(tmp_path / var))
    prof = Profiler()
    prof.start()
    _work()
    path = prof.stop()
    assert path.parent == tmp_path / var
    _load_trace(path)


def test_directory_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "vllm"))
    monkeypatch.setenv("GRAPHRUNNER_TORCH_PROFILER_DIR", str(tmp_path / "gr"))
    assert resolve_profiler_dir() == tmp_path / "vllm"
    assert resolve_profiler_dir(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "")  # empty counts as unset
    assert resolve_profiler_dir() == tmp_path / "gr"
    assert Profiler(tmp_path / "ctor").directory == tmp_path / "ctor"


def test_constructor_directory_is_the_default(tmp_path: Path) -> None:
    prof = Profiler(tmp_path / "ctor")
    prof.start()
    path = prof.stop()
    assert path.parent == tmp_path / "ctor"


def test_error_cases(tmp_path: Path) -> None:
    prof = Profiler()
    with pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR"):
        prof.start()
    assert not prof.is_running
    with pytest.raises(ValueError, match="not running"):
        prof.stop()
    prof.start(tmp_path)
    try:
        with pytest.raises(ValueError, match="already running"):
            prof.start(tmp_path)
    finally:
        prof.stop()
    with pytest.raises(ValueError, match="not running"):
        prof.stop()
