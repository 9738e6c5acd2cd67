"""The MLP's gated activation, silu(gate) * up: its Triton kernel against the PyTorch reference on awkward sizes,
the GEMV with the activation in its prologue (GRAPHRUNNER_GEMV_ACT) against activation-then-reference on the row
loop, split-K and tensor-core paths with rows bit-equal whatever M, the routing in `silu_mul_linear` (exactly the
activation then `linear` unless switched on), the op's fallback and opcheck. The engine with it on (graphs ==
compiled, tokens within cuBLAS's top-5) is in test_gpu_gemv_engine.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphrunner.models import gemv
from graphrunner.models import linear as linear_mod
from graphrunner.models.activation import silu_mul_ref, silu_mul_triton
from graphrunner.models.gemv import GemvConfig, gemv_ref, gemv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
       torch.float16: {"rtol": 1e-3, "atol": 1e-3}}
# the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584): the tensor-core path is checked in fp16 on CPU
DOT_DTYPES = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


def _gate_up(t: int, half: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 2 * half, generator=g) * 3).to(dtype).to(DEVICE)  # wide range: silu's both tails


@pytest.mark.parametrize(("t", "half"), [(0, 8), (3, 0), (1, 1), (2, 5), (7, 100), (3, 1030), (1, 2500)])
def test_silu_mul_triton_matches_reference(t: int, half: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _gate_up(t, half, dtype, seed=t * 7 + half)
        got = silu_mul_triton(x)
        assert got.shape == (t, half) and got.dtype == dtype
        torch.testing.assert_close(got, silu_mul_ref(x), **TOL[dtype])
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(silu_mul_ref(x), F.silu(gate) * up, rtol=0, atol=0)


def test_silu_mul_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="equal width"):
        silu_mul_triton(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        silu_mul_ref(torch.zeros(8, device=DEVICE))


ACT_CASES = [  # m, n, k (the down projection's K: gate_up is [M, 2K]), config
    (1, 37, 50, GemvConfig(4, 16, 1)),
    (3, 30, 300, GemvConfig(2, 128, 2)),  # split-K: each split makes the activation of its own K range
    (8, 33, 1030, GemvConfig(8, 256, 1, num_warps=8)),  # last tile short
    (5, 64, 200, GemvConfig(16, 64, 2, use_dot=True)),  # tensor cores: [16, BK] activation tiles
    (2, 17, 15, GemvConfig(1, 16, 1)),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), ACT_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_act_prologue_matches_activation_then_linear(m: int, n: int, k: int, config: GemvConfig, bias: bool) -> None:
    for dtype in DOT_DTYPES if config.use_dot else (torch.bfloat16, torch.float16):
        gu = _gate_up(m, k, dtype, seed=m + n + k)
        g = torch.Generator().manual_seed(n)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
        b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
        got = gemv_triton(gu, w, b, config, silu_mul=True)
        assert got.shape == (m, n) and got.dtype == dtype
        # the product against the reference over the kernel's own activation (tight), then the whole against the
        # reference activation, whose exp may round a few products to the neighbouring value (tolerance by scale)
        torch.testing.assert_close(got, gemv_ref(silu_mul_triton(gu), w, b), **TOL[dtype])
        expected = gemv_ref(gu, w, b, silu_mul=True)
        torch.testing.assert_close(got, expected, rtol=TOL[dtype]["rtol"], atol=expected.abs().max().item() * 1e-2)
        for rows in (1, m):  # rows bit-equal whatever M
            assert torch.equal(gemv_triton(gu[:rows], w, b, config, silu_mul=True), got[:rows])


def test_act_prologue_rejects_bad_input() -> None:
    w = torch.zeros(4, 6, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[M, 2K\]"):
        gemv_triton(torch.zeros(1, 6, dtype=torch.float16, device=DEVICE), w, None, silu_mul=True)
    with pytest.raises(ValueError, match="not both"):
        gemv_triton(torch.zeros(1, 12, dtype=torch.float16, device=DEVICE), w, None, silu_mul=True,
                    norm=(torch.ones(6, dtype=torch.float16, device=DEVICE), 1e-6))


def test_silu_mul_linear_routing_and_op_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """silu_mul_linear is exactly the activation then linear unless GRAPHRUNNER_GEMV_ACT routes it (CUDA, tuned
    weight); the op takes the prologue under a row-loop config, the activation's kernel then the GEMV under a
    tensor-core one, the activation and F.linear where no config serves M, and passes opcheck."""
    gu = _gate_up(3, 40, torch.bfloat16, seed=6)
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(24, 40, generator=g) / 40**0.5).to(torch.bfloat16).to(DEVICE)
    b = torch.randn(24, generator=g).to(torch.bfloat16).to(DEVICE)
    gate, up = gu.chunk(2, dim=-1)
    expected = F.linear(F.silu(gate) * up, w, b)
    cfg = GemvConfig(4, 32, 1, max_m=2)
    monkeypatch.setattr(gemv, "tuned_configs", lambda: {(24, 40): (cfg,)})
    for flag in (False, True):
        monkeypatch.setattr(gemv, "ACT_PROLOGUE", flag)
        got = linear_mod.silu_mul_linear(gu, w, b)  # M = 3 > max_m, or off, or CPU
        if flag and DEVICE == "cuda":  # the fallback's one-kernel activation may round differently from eager's
            torch.testing.assert_close(got, expected, **TOL[torch.bfloat16])
        else:
            assert torch.equal(got, expected)
    op = torch.ops.graphrunner.small_m_silu_mul_linear
    torch.testing.assert_close(op(gu, w, b), expected, **TOL[torch.bfloat16])
    if DEVICE == "cuda":  # M = 2: the prologue
        assert torch.equal(op(gu[:2], w, b), gemv_triton(gu[:2], w, b, cfg, silu_mul=True))
        dot = GemvConfig(16, 32, 1, max_m=4, use_dot=True)  # tensor cores: the activation's kernel, then the GEMV
        monkeypatch.setattr(gemv, "tuned_configs", lambda: {(24, 40): (cfg, dot)})
        assert torch.equal(op(gu, w, b), gemv_triton(silu_mul_triton(gu), w, b, dot))
    torch.library.opcheck(op.default, (gu, w, b), test_utils=("test_schema", "test_faketensor"))


def test_bad_switch_value_is_refused() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRAPHRUNNER_GEMV_ACT": "yes"}
    got = subprocess.run([sys.executable, "-c", "import graphrunner.models.gemv"], env=env, capture_output=True,
                         text=True, check=False, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert got.returncode != 0 and "GRAPHRUNNER_GEMV_ACT must be one of 0, 1" in got.stderr, got.stderr

