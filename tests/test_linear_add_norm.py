"""models/linear_add_norm.py: the GEMV's split-K partials summed by the add + norm kernel, against the GEMV with its
own split-K tail followed by add_rms_norm (bit for bit: the same float32 sums in the same order), and the partials
add + norm kernel against its PyTorch reference on awkward sizes; bad input; on a GPU, the two ops against the
unfused path at every small M for the 0.6B layer shapes and for untuned ones, and the opcheck of both ops.
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.models import gate_up_act, gemv
from graphrunner.models import linear_add_norm as lan
from graphrunner.models import norm as norm_mod
from graphrunner.models.gemv import GemvConfig, gemv_triton, split_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584): the tensor-core path runs in fp16 on CPU
DTYPES = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


def _rand(*shape: int, g: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize(("s", "t", "d"), [(1, 1, 1), (2, 3, 7), (3, 5, 100), (8, 2, 1000), (5, 8, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_partials_kernel_matches_reference(s: int, t: int, d: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(s * 100 + t * 10 + d)
    # (bf16 on CUDA only: the interpreter's bf16 casts may truncate, and two of them land an ulp or two apart)
    for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ()):
        parts = _rand(s, t, d, g=g, dtype=torch.float32)
        b = _rand(d, g=g, dtype=dtype) if bias else None
        residual, weight = _rand(t, d, g=g, dtype=dtype, scale=4.0), (torch.rand(d, generator=g) + 0.5).to(dtype)
        weight = weight.to(DEVICE)
        normed, summed = lan.partials_add_rms_norm_triton(parts, b, residual, weight, 1e-6)
        ref_normed, ref_summed = lan.partials_add_rms_norm_ref(parts, b, residual, weight, 1e-6)
        assert normed.shape == summed.shape == (t, d) and normed.dtype == summed.dtype == dtype
        assert torch.equal(summed, ref_summed)  # the same float32 sums, rounded once to the dtype, then the add
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
        torch.testing.assert_close(normed, ref_normed, **tol)


def test_partials_kernel_empty_rows_and_bad_input() -> None:
    parts = torch.zeros(2, 0, 16, device=DEVICE)
    residual, weight = torch.zeros(0, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    normed, summed = lan.partials_add_rms_norm_triton(parts, None, residual, weight, 1e-6)
    assert normed.shape == summed.shape == (0, 16)
    good = torch.zeros(2, 3, 16, device=DEVICE)
    residual = torch.zeros(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="must agree"):
        lan.partials_add_rms_norm_triton(good[:, :2], None, residual, weight, 1e-6)
    with pytest.raises(ValueError, match="must agree"):
        lan.partials_add_rms_norm_triton(good, None, residual, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="parts must be"):
        lan.partials_add_rms_norm_triton(good.half(), None, residual, weight, 1e-6)
    with pytest.raises(ValueError, match="K >= 1"):
        lan.gemv_partials(torch.zeros(1, 0, device=DEVICE, dtype=torch.float16),
                          torch.zeros(4, 0, device=DEVICE, dtype=torch.float16), GemvConfig(16, 16, 2))


CASES = [  # m, n, k, config: every one splits K (the partials path)
    (1, 37, 300, GemvConfig(4, 64, 3)),  # row loop, last split short
    (3, 100, 1030, GemvConfig(16, 64, 4)),
    (8, 70, 129, GemvConfig(4, 16, 5)),  # more splits than fit: no empty split
    (5, 48, 512, GemvConfig(16, 64, 2, use_dot=True)),
    (8, 70, 1030, GemvConfig(64, 128, 3, use_dot=True, swap_ab=True)),  # one N tile
    (2, 130, 600, GemvConfig(32, 128, 4, num_stages=2, use_dot=True, swap_ab=True)),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_partials_then_add_norm_equal_the_gemv_then_add_norm(m: int, n: int, k: int, config: GemvConfig,
                                                              bias: bool) -> None:
    assert split_plan(k, config)[1] > 1
    g = torch.Generator().manual_seed(m * 7 + n + k)
    for dtype in DTYPES:
        x, w = _rand(m, k, g=g, dtype=dtype), _rand(n, k, g=g, dtype=dtype, scale=k ** -0.5)
        b = _rand(n, g=g, dtype=dtype) if bias else None
        residual, norm_w = _rand(m, n, g=g, dtype=dtype, scale=4.0), _rand(n, g=g, dtype=dtype).abs() + 0.5
        parts = lan.gemv_partials(x, w, config)
        assert parts.shape == (split_plan(k, config)[1], m, n) and parts.dtype == torch.float32
        fused = lan.partials_add_rms_norm_triton(parts, b, residual, norm_w, 1e-6)
        unfused = norm_mod.add_rms_norm_triton(gemv_triton(x, w, b, config), residual, norm_w, 1e-6)
        assert torch.equal(fused[1], unfused[1]) and torch.equal(fused[0], unfused[0])


def test_ops_route_only_where_the_gemv_splits_and_cpu_takes_the_unfused_path() -> None:
    """On CPU (and for weights the GEMV does not serve) both ops are exactly the projection, then add_rms_norm."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(3, 24, generator=g), torch.randn(16, 24, generator=g), torch.randn(16, generator=g)
    residual, norm_w = torch.randn(3, 16, generator=g), torch.rand(16, generator=g) + 0.5
    got = lan.linear_add_rms_norm(x, w, b, residual, norm_w, 1e-6)
    want = norm_mod.add_rms_norm(torch.nn.functional.linear(x, w, b), residual, norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gu, down = torch.randn(40, 16, generator=g), torch.randn(16, 20, generator=g)
    got = lan.gated_mlp_add_rms_norm(residual, gu, None, down, None, residual, norm_w, 1e-6)
    mlp = gate_up_act.small_m_gated_mlp(residual, gu, None, down, None)
    want = norm_mod.add_rms_norm(mlp, residual, norm_w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not lan.routes(x, w)  # a CPU weight: the decoder keeps its two ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_ops_equal_the_unfused_path_at_every_small_m(dtype: torch.dtype) -> None:
    """The 0.6B o and MLP shapes (tuned: tensor-core splits at M = 5-8) and untuned ones (the heuristic's split row
    loop), M = 1..9: the ops give the projection-then-add_rms_norm bits, and take the partials path somewhere."""
    g = torch.Generator().manual_seed(0)
    used = []
    original = lan.gemv_partials

    def counting(*args: object) -> torch.Tensor:
        used.append(1)
        return original(*args)  # type: ignore[arg-type]

    lan.gemv_partials = counting  # type: ignore[assignment]
    try:
        for hidden, q_size, inter in ((1024, 2048, 3072), (96, 256, 200)):
            o_w = _rand(hidden, q_size, g=g, dtype=dtype, scale=q_size ** -0.5)
            gu_w = _rand(2 * inter, hidden, g=g, dtype=dtype, scale=hidden ** -0.5)
            down_w = _rand(hidden, inter, g=g, dtype=dtype, scale=inter ** -0.5)
            norm_w = _rand(hidden, g=g, dtype=dtype).abs() + 0.5
            for m in range(1, 10):
                attn, x = _rand(m, q_size, g=g, dtype=dtype), _rand(m, hidden, g=g, dtype=dtype)
                residual = _rand(m, hidden, g=g, dtype=dtype, scale=4.0)
                got = lan.linear_add_rms_norm(attn, o_w, None, residual, norm_w, 1e-6)
                want = norm_mod.add_rms_norm(gemv.small_m_linear(attn, o_w, None), residual, norm_w, 1e-6)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (hidden, m)
                got = lan.gated_mlp_add_rms_norm(x, gu_w, None, down_w, None, residual, norm_w, 1e-6)
                mlp = gate_up_act.small_m_gated_mlp(x, gu_w, None, down_w, None)
                want = norm_mod.add_rms_norm(mlp, residual, norm_w, 1e-6)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (hidden, m)
    finally:
        lan.gemv_partials = original  # type: ignore[assignment]
    assert used  # the partials path ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ops_pass_opcheck() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = _rand(6, 2048, g=g, dtype=torch.bfloat16), _rand(1024, 2048, g=g, dtype=torch.bfloat16, scale=0.02)
    residual, norm_w = _rand(6, 1024, g=g, dtype=torch.bfloat16), _rand(1024, g=g, dtype=torch.bfloat16).abs()
    torch.library.opcheck(torch.ops.graphrunner.linear_add_rms_norm.default, (x, w, None, residual, norm_w, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))
    h = _rand(6, 1024, g=g, dtype=torch.bfloat16)
    gu, down = _rand(6144, 1024, g=g, dtype=torch.bfloat16, scale=0.03), _rand(1024, 3072, g=g, dtype=torch.bfloat16,
                                                                              scale=0.02)
    torch.library.opcheck(torch.ops.graphrunner.gated_mlp_add_rms_norm.default,
                          (h, gu, None, down, None, residual, norm_w, 1e-6), test_utils=("test_schema", "test_faketensor"))


def test_bad_switch_value_is_refused() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "GRAPHRUNNER_GEMV_PARTIALS": "yes"}
    got = subprocess.run([sys.executable, "-c", "import graphrunner.models.linear_add_norm"], env=env,
                         capture_output=True, text=True, check=False, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert got.returncode != 0 and "GRAPHRUNNER_GEMV_PARTIALS must be one of 0, 1" in got.stderr, got.stderr
