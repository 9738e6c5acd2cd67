"""graphrunner.env: GRAPHRUNNER_* switches parse, default when unset, and refuse bad values naming the variable."""

from __future__ import annotations

import pytest

from graphrunner.env import env_choice, env_number

NAME = "GRAPHRUNNER_TEST_SWITCH"


@pytest.mark.parametrize(("raw", "want"), [(None, 7), ("", 7), (" 3 ", 3), ("128", 128)])
def test_integer_values_and_default(raw: str | None, want: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if raw is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, raw)
    assert env_number(NAME, 7, integer=True) == want


@pytest.mark.parametrize("raw", ["x", "1.5", "0", "-2"])
def test_bad_integers_name_the_variable_and_the_rule(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(ValueError, match=rf"^{NAME} must be an integer > 0; got '{raw}'$"):
        env_number(NAME, 1, integer=True, valid=lambda v: v > 0, rule="> 0")


def test_floats_and_a_none_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_number(NAME, None) is None
    monkeypatch.setenv(NAME, "2.5")
    assert env_number(NAME, None) == 2.5
    monkeypatch.setenv(NAME, "soon")
    with pytest.raises(ValueError, match=f"{NAME} must be a number; got 'soon'"):
        env_number(NAME, None)


def test_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_choice(NAME, ("a", "b"), "a") == "a"
    monkeypatch.setenv(NAME, " B ")
    assert env_choice(NAME, ("a", "b"), "a") == "b"
    monkeypatch.setenv(NAME, "c")
    with pytest.raises(ValueError, match=f"{NAME} must be one of a, b, got 'c'"):
        env_choice(NAME, ("a", "b"), "a")


@pytest.mark.parametrize(("value", "frozen"), [("1", True), ("0", False), ("yes", None)])
def test_gc_freeze_switch(value: str, frozen: bool | None) -> None:
    """GRAPHRUNNER_GC_FREEZE=1 freezes the collector's heap once the runner is ready (0 does not); a bad value is
    refused naming the variable."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import gc; from graphrunner import LLM, SamplingParams\n"
            f"llm = LLM(model={str(root / 'graphrunner' / 'demo_model')!r}, device='cpu', enforce_eager=True)\n"
            "out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))\n"
            "print('FROZEN', gc.get_freeze_count() > 0, len(out[0].outputs[0].token_ids))\n")
    got = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GRAPHRUNNER_GC_FREEZE": value},
                         capture_output=True, text=True, check=False, timeout=300, cwd=root)
    if frozen is None:
        assert got.returncode != 0 and "GRAPHRUNNER_GC_FREEZE must be one of 0, 1" in got.stderr, got.stderr
    else:
        assert got.returncode == 0, got.stderr[-2000:]
        assert f"FROZEN {frozen} 2" in got.stdout
