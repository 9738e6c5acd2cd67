"""Tests for graphrunner.models.gate_up_act (the gate-up GEMV with silu(gate) * up in its epilogue): Triton ==
PyTorch reference on awkward sizes, rows bit-equal whatever M, edge sizes, bad input, and the op
`graphrunner::small_m_gated_mlp` (its two-op path against the reference, its fake impl, and on CUDA its choice of
the fused kernel by the config serving M).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphrunner.models import gemv
from graphrunner.models.activation import silu_mul_ref
from graphrunner.models.gate_up_act import fusable, gate_up_act_ref, gate_up_act_triton
from graphrunner.models.gemv import GemvConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584): checked in fp16 on CPU
DTYPES = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]
TOL = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


def _data(m: int, half: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * half, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(2 * half, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


CASES = [  # m, I (each half), K, config of the gate-up weight
    (1, 16, 16, GemvConfig(32, 16, 1, use_dot=True, swap_ab=True)),
    (3, 37, 50, GemvConfig(32, 32, 1, use_dot=True, swap_ab=True)),  # I and K not multiples of the blocks
    (8, 70, 130, GemvConfig(64, 64, 1, num_stages=2, use_dot=True, swap_ab=True)),
    (5, 100, 300, GemvConfig(128, 128, 1, num_warps=8, use_dot=True, swap_ab=True)),
]


@pytest.mark.parametrize(("m", "half", "k", "config"), CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("one_dot", [False, True])
def test_triton_matches_reference(m: int, half: int, k: int, config: GemvConfig, bias: bool, one_dot: bool) -> None:
    for dtype in DTYPES:
        x, w, b = _data(m, half, k, dtype, seed=m + half + k, bias=bias)
        out = gate_up_act_triton(x, w, b, config, one_dot=one_dot)
        assert out.shape == (m, half) and out.dtype == dtype
        torch.testing.assert_close(out, gate_up_act_ref(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("one_dot", [False, True])
def test_rows_bit_equal_whatever_m(one_dot: bool) -> None:
    """Row i of an M-row call equals the same row alone or in any other M (graphs pad M; rows must not notice)."""
    config = GemvConfig(32, 32, 1, use_dot=True, swap_ab=True)
    x, w, b = _data(gemv.MAX_M, 40, 100, DTYPES[-1], seed=3, bias=True)
    full = gate_up_act_triton(x, w, b, config, one_dot=one_dot)
    for m in range(1, gemv.MAX_M + 1) if DEVICE == "cuda" else (1, 4, 7):  # (the interpreter is slow)
        assert torch.equal(gate_up_act_triton(x[:m], w, b, config, one_dot=one_dot), full[:m]), m
    assert torch.equal(gate_up_act_triton(x[6:7], w, b, config, one_dot=one_dot), full[6:7])


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter's tl.dot is one matmul whatever the tile's rows")
def test_one_dot_at_the_06b_shape_matches_the_reference() -> None:
    """The shipped gate-up config of Qwen3-0.6B (6144 x 1024, 32 rows a half) through one wgmma tile a program, at
    the token counts it serves, against the reference (bf16)."""
    config = GemvConfig(64, 256, 1, num_stages=3, use_dot=True, swap_ab=True)
    x, w, b = _data(gemv.MAX_M, 3072, 1024, torch.bfloat16, seed=11, bias=False)
    for m in (2, 5, 8):
        torch.testing.assert_close(gate_up_act_triton(x[:m], w, b, config, one_dot=True), gate_up_act_ref(x[:m], w, b),
                                   **TOL[torch.bfloat16])


def test_edge_sizes() -> None:
    config = GemvConfig(32, 32, 1, use_dot=True, swap_ab=True)
    x, w, b = _data(0, 20, 30, torch.float16, seed=1, bias=True)
    assert gate_up_act_triton(x, w, b, config).shape == (0, 20)
    x, w, b = _data(3, 20, 0, torch.float16, seed=1, bias=True)
    assert b is not None
    assert torch.equal(gate_up_act_triton(x, w, b, config), silu_mul_ref(b.expand(3, 40)))
    assert torch.equal(gate_up_act_triton(x, w, None, config), torch.zeros(3, 20, dtype=x.dtype, device=DEVICE))


def test_fusable_configs_and_bad_input() -> None:
    assert fusable(GemvConfig(32, 64, 1, use_dot=True, swap_ab=True))
    assert not fusable(None)
    assert not fusable(GemvConfig(4, 64, 1))  # the row loop
    assert not fusable(GemvConfig(32, 64, 1, use_dot=True))  # x as the A operand
    assert not fusable(GemvConfig(32, 64, 2, use_dot=True, swap_ab=True))  # split K: no program has whole sums
    assert not fusable(GemvConfig(16, 64, 1, use_dot=True, swap_ab=True))  # 8 rows a half: under the MMA's 16
    config = GemvConfig(32, 32, 1, use_dot=True, swap_ab=True)
    x, w, b = _data(2, 20, 30, torch.float16, seed=2, bias=True)
    with pytest.raises(ValueError, match="cannot run fused"):
        gate_up_act_triton(x, w, b, GemvConfig(32, 32, 2, use_dot=True, swap_ab=True))
    with pytest.raises(ValueError, match="halves of equal height"):
        gate_up_act_triton(x, w[:39], None, config)
    with pytest.raises(ValueError, match="disagree on K"):
        gate_up_act_triton(x, w[:, :29], b, config)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gate_up_act_triton(torch.zeros(9, 30, dtype=x.dtype, device=DEVICE), w, b, config)
    with pytest.raises(ValueError, match="bias has 39 entries"):
        gate_up_act_triton(x, w, b[:39], config)


def _mlp_ref(x: torch.Tensor, w_gu: torch.Tensor, b_gu: torch.Tensor | None, w_down: torch.Tensor,
             b_down: torch.Tensor | None) -> torch.Tensor:
    return gemv.gemv_ref(gate_up_act_ref(x, w_gu, b_gu), w_down, b_down)


def test_op_two_op_path_and_fake_impl() -> None:
    """Without a fusable config (always on CPU) the op is the gate-up linear, then the activation and down."""
    x, w_gu, b_gu = _data(3, 24, 40, torch.float16, seed=5, bias=True)
    w_down = (torch.randn(40, 24, generator=torch.Generator().manual_seed(6)) / 5).half().to(DEVICE)
    got = torch.ops.graphrunner.small_m_gated_mlp(x, w_gu, b_gu, w_down, None)
    expected = F.linear(silu_mul_ref(F.linear(x, w_gu, b_gu)), w_down)
    torch.testing.assert_close(got, expected, **TOL[torch.float16])
    torch.library.opcheck(torch.ops.graphrunner.small_m_gated_mlp.default, (x, w_gu, b_gu, w_down, None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_gpu_op_takes_the_fused_kernel_where_the_config_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table whose gate-up config is fusable from 3 tokens: the fused kernel runs at M = 3..8, not at M = 1..2,
    and every M matches the reference."""
    from graphrunner.models import gate_up_act

    half, k, hidden = 96, 128, 128
    table = {(2 * half, k): (GemvConfig(4, 64, 1, max_m=2), GemvConfig(64, 64, 1, max_m=8, use_dot=True,
                                                                         swap_ab=True)),
             (hidden, half): (GemvConfig(4, 32, 1, max_m=8),)}
    monkeypatch.setattr(gemv, "tuned_configs", lambda: table)
    calls = [0]
    original = gate_up_act.gate_up_act_triton

    def counting(*args: object) -> torch.Tensor:
        calls[0] += 1
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gate_up_act, "gate_up_act_triton", counting)
    x, w_gu, b_gu = _data(gemv.MAX_M, half, k, torch.bfloat16, seed=9, bias=True)
    w_down = (torch.randn(hidden, half, generator=torch.Generator().manual_seed(4)) / 10).bfloat16().cuda()
    for m in range(1, gemv.MAX_M + 1):
        before = calls[0]
        got = torch.ops.graphrunner.small_m_gated_mlp(x[:m], w_gu, b_gu, w_down, None)
        torch.testing.assert_close(got, _mlp_ref(x[:m], w_gu, b_gu, w_down, None), **TOL[torch.bfloat16])
        assert calls[0] - before == (1 if m >= 3 else 0), m
