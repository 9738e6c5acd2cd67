"""choose_num_splits honours SPLIT_MIN_SEQ_LEN / SPLIT_MIN_KEYS (GRAPHRUNNER_ATTN_SPLIT_MIN_LEN / _MIN_KEYS),
never exceeds MAX_SPLITS and never splits a launch that already has _TARGET_PROGRAMS programs; bad values of the
attention module's environment knobs and switches stop the import with a message naming them (CPU only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphrunner.attention import triton_attention as ta
from graphrunner.attention.triton_attention import choose_num_splits


def test_old_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ta, "SPLIT_MIN_SEQ_LEN", 1024)  # the rule before the H200 measurement
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 256)
    assert choose_num_splits(1, 8, 330) == 1
    assert choose_num_splits(1, 8, 1023) == 1
    assert choose_num_splits(1, 8, 1024) == min(ta.MAX_SPLITS, 4)  # one split per 256 keys


def test_default_rule_splits_short_decode_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ta, "MAX_SPLITS", 16)
    assert choose_num_splits(1, 8, 127) == 1  # below 128 keys splitting did not pay on the H200
    assert choose_num_splits(1, 8, 200) == 4  # one split per 64 keys
    assert choose_num_splits(1, 8, 330) == 6  # one split per 64 keys
    assert choose_num_splits(1, 8, 4096) == 16
    assert choose_num_splits(8, 8, 512) == 5  # ~2 waves of 132 SMs


def test_min_seq_len(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 256)
    monkeypatch.setattr(ta, "SPLIT_MIN_SEQ_LEN", 1024)
    assert choose_num_splits(1, 8, 330) == 1
    monkeypatch.setattr(ta, "SPLIT_MIN_SEQ_LEN", 128)
    assert choose_num_splits(1, 8, 330) == 2  # ceil(330 / 256)
    assert choose_num_splits(1, 8, 127) == 1


def test_min_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ta, "SPLIT_MIN_SEQ_LEN", 128)
    monkeypatch.setattr(ta, "MAX_SPLITS", 16)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 64)
    assert choose_num_splits(1, 8, 330) == 6  # ceil(330 / 64)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 16)
    assert choose_num_splits(1, 8, 330) == 16  # capped by MAX_SPLITS
    assert choose_num_splits(8, 8, 330) == 5  # capped by ceil(_TARGET_PROGRAMS / 64 programs)


@pytest.mark.parametrize("max_splits", [1, 3, 16])
@pytest.mark.parametrize("min_keys", [16, 64, 256])
def test_bounds(max_splits: int, min_keys: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ta, "SPLIT_MIN_SEQ_LEN", 1)
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", min_keys)
    monkeypatch.setattr(ta, "MAX_SPLITS", max_splits)
    for num_reqs in (1, 2, 4, 8, 16, 33, 256):
        for seq in (1, 16, 70, 330, 1024, 8192, 1 << 20):
            n = choose_num_splits(num_reqs, 8, seq)
            assert isinstance(n, int) and 1 <= n <= max_splits, (num_reqs, seq, n)
            assert n <= -(-seq // min_keys)
            if num_reqs * 8 >= ta._TARGET_PROGRAMS:
                assert n == 1, (num_reqs, seq, n)


def _constants(env: dict[str, str], code: str = "from graphrunner.attention import triton_attention as t; "
               "print(t.SPLIT_MIN_SEQ_LEN, t.SPLIT_MIN_KEYS)") -> subprocess.CompletedProcess:
    """What `code` prints in a fresh interpreter under `env` (the module-level constants are read at import); by
    default SPLIT_MIN_SEQ_LEN and SPLIT_MIN_KEYS."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHRUNNER_ATTN_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=False, timeout=120, cwd=Path(__file__).resolve().parents[1])


def test_env_values_are_read() -> None:
    assert _constants({}).stdout.split() == ["128", "64"]
    got = _constants({"GRAPHRUNNER_ATTN_SPLIT_MIN_LEN": "256", "GRAPHRUNNER_ATTN_SPLIT_MIN_KEYS": "32"})
    assert got.stdout.split() == ["256", "32"], got.stderr


def test_target_programs_is_read() -> None:
    """GRAPHRUNNER_ATTN_TARGET_PROGRAMS=64: batch 8 of 8 KV heads (64 programs) no longer splits, batch 1 still does."""
    code = ("from graphrunner.attention.triton_attention import choose_num_splits as c; "
            "print(c(8, 8, 512), c(4, 8, 512), c(1, 8, 512))")
    for target, want in (("", ["5", "8", "8"]), ("64", ["1", "2", "8"]), ("128", ["2", "4", "8"])):
        got = _constants({"GRAPHRUNNER_ATTN_TARGET_PROGRAMS": target}, code)
        assert got.stdout.split() == want, (target, got.stderr)


@pytest.mark.parametrize(("name", "raw"), [("GRAPHRUNNER_ATTN_SPLIT_MIN_LEN", "0"),
                                           ("GRAPHRUNNER_ATTN_SPLIT_MIN_KEYS", "8"),
                                           ("GRAPHRUNNER_ATTN_WARPS", "6"), ("GRAPHRUNNER_ATTN_TILE", "48"),
                                           ("GRAPHRUNNER_ATTN_TARGET_PROGRAMS", "0")])
def test_bad_env_values_are_refused(name: str, raw: str) -> None:
    got = _constants({name: raw})
    assert got.returncode != 0 and f"{name} must be an integer" in got.stderr, got.stderr


@pytest.mark.parametrize(("name", "raw"), [("GRAPHRUNNER_ATTN_FOLD_MERGE", "yes"), ("GRAPHRUNNER_ATTN_PREFETCH", "on")])
def test_bad_switch_values_are_refused(name: str, raw: str) -> None:
    got = _constants({name: raw})
    assert got.returncode != 0 and f"{name} must be one of 0, 1, got '{raw}'" in got.stderr, got.stderr
