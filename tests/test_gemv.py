"""Tests for graphrunner.models.gemv (the small-M Triton linear; measured, not wired into the models): Triton ==
float32-accumulating PyTorch reference on awkward M/N/K (split-K and not, dot and reduce paths, bias), edge sizes,
bad input, the custom op's fake impl (torch.library.opcheck) and its trace with a dynamic token count.

CPU runs Triton in interpreter mode, whose tl.dot mishandles bf16: there the tensor-core path is checked in fp16
and bf16 goes through the reduce path; on CUDA every combination runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton

from graphrunner.models import gemv
from graphrunner.models.gemv import GemvConfig, default_config, gemv_ref, gemv_triton, load_tuned_configs, pick_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


def _data(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def _dtypes(use_dot: bool) -> list[torch.dtype]:
    return [torch.float16] if use_dot and DEVICE == "cpu" else [torch.bfloat16, torch.float16]


CASES = [  # m, n, k, config (None: default_config)
    (1, 1, 1, None),
    (1, 37, 50, None),
    (3, 100, 300, None),
    (8, 70, 1030, GemvConfig(16, 64, 4)),  # split-K, last split short
    (5, 33, 200, GemvConfig(32, 32, 3, use_dot=False)),
    (2, 17, 15, GemvConfig(16, 16, 1, use_dot=False)),
    (7, 130, 129, GemvConfig(64, 16, 5)),  # more splits than fit: k_per_split rounds up, no empty split
    (1, 50, 1000, GemvConfig(16, 128, 2, use_dot=False)),
    (6, 90, 700, GemvConfig(32, 64, 3, serial_reduce=True)),  # the last split of each tile sums in-kernel
    (1, 40, 513, GemvConfig(16, 64, 4, use_dot=False, serial_reduce=True)),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matches_reference(m: int, n: int, k: int, config: GemvConfig | None, bias: bool) -> None:
    for dtype in _dtypes(config.use_dot if config is not None else m > 1):
        x, w, b = _data(m, n, k, dtype, seed=m * 1000 + n + k, bias=bias)
        out = gemv_triton(x, w, b, config)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out, gemv_ref(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("bias", [False, True])
def test_serial_reduce_equals_reduce_kernel_bit_for_bit(bias: bool) -> None:
    x, w, b = _data(3, 200, 900, torch.float16, seed=7, bias=bias)
    two_kernels = gemv_triton(x, w, b, GemvConfig(16, 64, 4))
    for _ in range(3):  # the counters reset themselves: repeated launches (graph replays) stay right
        assert torch.equal(gemv_triton(x, w, b, GemvConfig(16, 64, 4, serial_reduce=True)), two_kernels)
    assert not gemv._counters[x.device].any()


def test_strided_inputs() -> None:
    x, w, b = _data(4, 40, 96, torch.float16, seed=1, bias=True)
    wide_x = torch.zeros(4, 200, dtype=x.dtype, device=DEVICE)
    wide_x[:, 50:146] = x
    wide_w = torch.zeros(40, 128, dtype=w.dtype, device=DEVICE)
    wide_w[:, :96] = w
    out = gemv_triton(wide_x[:, 50:146], wide_w[:, :96], b, GemvConfig(16, 32, 2))
    torch.testing.assert_close(out, gemv_ref(x, w, b), **TOL[torch.float16])
    transposed = w.t().contiguous().t()  # K not unit-stride: copied to a contiguous weight first
    torch.testing.assert_close(gemv_triton(x, transposed, b), gemv_ref(x, w, b), **TOL[torch.float16])


def test_edge_sizes() -> None:
    x, w, b = _data(0, 20, 30, torch.bfloat16, seed=2, bias=True)
    assert gemv_triton(x, w, b).shape == (0, 20)
    x, w, b = _data(3, 0, 30, torch.bfloat16, seed=2, bias=False)
    assert gemv_triton(x, w, b).shape == (3, 0)
    x, w, b = _data(3, 20, 0, torch.bfloat16, seed=2, bias=True)
    assert b is not None
    assert torch.equal(gemv_triton(x, w, b), b.expand(3, 20))
    assert torch.equal(gemv_triton(x, w, None), torch.zeros(3, 20, dtype=x.dtype, device=DEVICE))


def test_bad_input_raises_value_error() -> None:
    x, w, b = _data(2, 20, 30, torch.bfloat16, seed=3, bias=True)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv_triton(torch.zeros(9, 30, dtype=x.dtype, device=DEVICE), w, b)
    with pytest.raises(ValueError, match="disagree on K"):
        gemv_triton(x, w[:, :29], b)
    with pytest.raises(ValueError, match="x must be"):
        gemv_triton(x.float(), w, b)
    with pytest.raises(ValueError, match="weight must be"):
        gemv_triton(x, w.half(), b)
    with pytest.raises(ValueError, match="bias has 19 entries"):
        gemv_triton(x, w, b[:19])
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(24, 64, 1)
    with pytest.raises(ValueError, match="split_k"):
        GemvConfig(16, 64, 0)


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize(("n", "k"), [(1024, 2048), (4096, 1024), (6144, 1024), (1024, 3072), (151_936, 1024)])
def test_default_config_is_valid_and_splits_k_only_when_n_is_small(m: int, n: int, k: int) -> None:
    cfg = default_config(m, n, k, torch.device(DEVICE))
    assert cfg.block_k <= k and cfg.split_k * cfg.block_k <= k
    if triton.cdiv(n, cfg.block_n) >= 4 * gemv._num_sms(torch.device(DEVICE)):
        assert cfg.split_k == 1


def test_tuned_table_lookup(tmp_path: Path) -> None:
    path = tmp_path / "gemv_configs.json"
    cfg = {"block_n": 32, "block_k": 128, "split_k": 2, "num_warps": 4, "num_stages": 3, "use_dot": True}
    path.write_text(json.dumps([{"M": 4, "N": 100, "K": 300, "config": cfg, "us": 3.0},
                                {"M": 8, "N": 100, "K": 300, "config": None, "us": 5.0}]))
    table = load_tuned_configs(path)
    dev = torch.device(DEVICE)
    assert pick_config(3, 100, 300, dev, table) == GemvConfig(32, 128, 2)  # the smallest tuned M >= 3
    assert pick_config(4, 100, 300, dev, table) == GemvConfig(32, 128, 2)
    assert pick_config(6, 100, 300, dev, table) is None  # cuBLAS won there
    assert pick_config(2, 100, 301, dev, table) == default_config(2, 100, 301, dev)  # untuned shape
    path.write_text(json.dumps([{"M": 4, "N": 100}]))
    with pytest.raises(ValueError, match="bad GEMV config file"):
        load_tuned_configs(path)


def test_custom_op_falls_back_above_max_m_and_passes_opcheck() -> None:
    x, w, b = _data(gemv.MAX_M + 1, 24, 40, torch.bfloat16, seed=4, bias=True)
    assert torch.equal(torch.ops.graphrunner.small_m_linear(x, w, b), F.linear(x, w, b))
    x32 = x[:3].float()  # float32 never reaches the kernel
    assert torch.equal(torch.ops.graphrunner.small_m_linear(x32, w.float(), None), F.linear(x32, w.float()))
    small = _data(3, 24, 40, torch.float16, seed=5, bias=True)
    torch.testing.assert_close(torch.ops.graphrunner.small_m_linear(*small), gemv_ref(*small), **TOL[torch.float16])
    torch.library.opcheck(torch.ops.graphrunner.small_m_linear.default, small,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_gpu_serial_reduce_under_load() -> None:
    """Many tiles x splits racing on the counters, repeated: every result equals the two-kernel reduction."""
    x, w, b = _data(8, 4096, 3072, torch.bfloat16, seed=8, bias=True)
    for block_n, block_k in ((16, 128), (32, 64)):
        expected = gemv_triton(x, w, b, GemvConfig(block_n, block_k, 8))  # same partials, summed by a 2nd kernel
        torch.testing.assert_close(expected, gemv_ref(x, w, b), **TOL[torch.bfloat16])
        for _ in range(200):
            assert torch.equal(gemv_triton(x, w, b, GemvConfig(block_n, block_k, 8, serial_reduce=True)), expected)


def test_op_traces_with_dynamic_token_count() -> None:
    """fullgraph torch.compile (aot_eager: Dynamo + AOTAutograd over the fake impl) with a symbolic M."""

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(torch.ops.graphrunner.small_m_linear(x, w, b)) * 2

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (2, 3, 9):  # the Triton path twice (one trace), then cuBLAS/F.linear at run time, same graph
        x, w, b = _data(m, 24, 40, torch.float16, seed=m, bias=True)
        expected = F.silu(gemv_ref(x, w, b) if m <= gemv.MAX_M else F.linear(x, w, b)) * 2
        torch.testing.assert_close(compiled(x, w, b), expected, **TOL[torch.float16])
