"""Tests for graphrunner.models.gemv (the small-M Triton linear behind `linear()` for tuned shapes): Triton ==
float32-accumulating PyTorch reference on awkward M/N/K (split-K and not, bias), rows bit-equal whatever M
(batch invariance), edge sizes, bad input, the tuned table, the routing in `linear()`, the custom op's fake impl
(torch.library.opcheck) and its trace with a dynamic token count.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton

from graphrunner.models import gemv
from graphrunner.models import linear as linear_mod
from graphrunner.models.gemv import GemvConfig, default_config, gemv_ref, gemv_triton, load_tuned_configs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


def _data(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


CASES = [  # m, n, k, config (None: default_config)
    (1, 1, 1, None),
    (1, 37, 50, None),
    (3, 100, 300, None),
    (8, 70, 1030, GemvConfig(16, 64, 4)),  # split-K, last split short
    (5, 33, 200, GemvConfig(32, 32, 3)),
    (2, 17, 15, GemvConfig(1, 16, 1)),  # one output feature per program
    (7, 50, 129, GemvConfig(4, 16, 5)),  # more splits than fit: k_per_split rounds up, no empty split
    (1, 50, 1000, GemvConfig(8, 128, 2, num_warps=2)),
    (6, 90, 700, GemvConfig(2, 256, 3, num_stages=3)),
    (1, 40, 513, GemvConfig(16, 64, 4, num_warps=8)),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matches_reference(m: int, n: int, k: int, config: GemvConfig | None, bias: bool) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        x, w, b = _data(m, n, k, dtype, seed=m * 1000 + n + k, bias=bias)
        out = gemv_triton(x, w, b, config)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out, gemv_ref(x, w, b), **TOL[dtype])


# the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584): the tensor-core path is checked in fp16 on CPU
DOT_DTYPES = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize(("m", "n", "k", "config"), [
    (2, 37, 50, GemvConfig(16, 16, 1, use_dot=True)),
    (8, 70, 1030, GemvConfig(32, 64, 4, use_dot=True)),  # split-K, last split short
    (5, 100, 300, GemvConfig(16, 128, 1, num_warps=8, use_dot=True)),
    (3, 37, 50, GemvConfig(16, 16, 1, use_dot=True, swap_ab=True)),  # the weight tile as the MMA's A operand
    (8, 70, 1030, GemvConfig(64, 128, 3, use_dot=True, swap_ab=True)),  # one N tile, short last split
    (1, 130, 96, GemvConfig(32, 128, 1, num_stages=2, use_dot=True, swap_ab=True)),  # BLOCK_K past K
])
@pytest.mark.parametrize("bias", [False, True])
def test_dot_path_matches_reference(m: int, n: int, k: int, config: GemvConfig, bias: bool) -> None:
    for dtype in DOT_DTYPES:
        x, w, b = _data(m, n, k, dtype, seed=m + n + k, bias=bias)
        torch.testing.assert_close(gemv_triton(x, w, b, config), gemv_ref(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("config", [GemvConfig(4, 64, 1), GemvConfig(8, 32, 3), GemvConfig(1, 128, 2),
                                    GemvConfig(16, 64, 2, use_dot=True),
                                    GemvConfig(32, 64, 2, use_dot=True, swap_ab=True)])
def test_rows_bit_equal_whatever_m(config: GemvConfig) -> None:
    """Row i of an M-row call equals the same row alone or in any other M (what keeps graphs == eager when a
    step is padded from M to the next captured size)."""
    x, w, b = _data(gemv.MAX_M, 30, 200, DOT_DTYPES[-1] if config.use_dot else torch.bfloat16, seed=11, bias=True)
    full = gemv_triton(x, w, b, config)
    for m in range(1, gemv.MAX_M + 1) if DEVICE == "cuda" else (1, 3, 7):  # (the interpreter is slow)
        assert torch.equal(gemv_triton(x[:m], w, b, config), full[:m]), m
    assert torch.equal(gemv_triton(x[5:6], w, b, config), full[5:6])


def test_split_k_counters_reset_across_launches() -> None:
    x, w, b = _data(3, 200, 900, torch.float16, seed=7, bias=True)
    first = gemv_triton(x, w, b, GemvConfig(16, 64, 4))
    for _ in range(3):  # the counters reset themselves: repeated launches (graph replays) stay right
        assert torch.equal(gemv_triton(x, w, b, GemvConfig(16, 64, 4)), first)
    assert not gemv._counters[x.device].any()
    torch.testing.assert_close(first, gemv_ref(x, w, b), **TOL[torch.float16])


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
    with pytest.raises(ValueError, match="block_k"):
        GemvConfig(4, 8, 1)
    with pytest.raises(ValueError, match="split_k"):
        GemvConfig(16, 64, 0)
    with pytest.raises(ValueError, match="max_m"):
        GemvConfig(16, 64, 1, max_m=3)
    with pytest.raises(ValueError, match="tl.dot config needs block_n"):
        GemvConfig(8, 64, 1, use_dot=True)
    with pytest.raises(ValueError, match="swap_ab .* needs use_dot"):
        GemvConfig(16, 64, 1, swap_ab=True)


@pytest.mark.parametrize(("n", "k"), [(1024, 2048), (4096, 1024), (6144, 1024), (1024, 3072), (151_936, 1024), (5, 7)])
def test_default_config_is_valid_and_splits_k_only_when_n_is_small(n: int, k: int) -> None:
    cfg = default_config(n, k, torch.device(DEVICE))
    assert cfg.block_k <= max(16, triton.next_power_of_2(k)) and cfg.split_k * cfg.block_k <= max(k, cfg.block_k)
    if triton.cdiv(n, cfg.block_n) >= 2 * gemv._num_sms(torch.device(DEVICE)):
        assert cfg.split_k == 1


def _write_table(path: Path, entries: list[dict]) -> None:
    path.write_text(json.dumps(entries))


def test_tuned_table_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gemv_configs.json"
    loop = {"block_n": 4, "block_k": 128, "split_k": 2, "num_warps": 4, "num_stages": 1, "max_m": 2}
    dot = {"block_n": 16, "block_k": 128, "max_m": 8, "use_dot": True}
    _write_table(path, [{"N": 100, "K": 300, "configs": [dot, loop]}, {"N": 50, "K": 300, "configs": []},
                        {"N": 60, "K": 300, "config": {**loop, "max_m": 4}}, {"N": 70, "K": 300, "config": None}])
    table = load_tuned_configs(path)
    assert table == {(100, 300): (GemvConfig(4, 128, 2, max_m=2), GemvConfig(16, 128, max_m=8, use_dot=True)),
                     (50, 300): (), (60, 300): (GemvConfig(4, 128, 2, max_m=4),), (70, 300): ()}
    monkeypatch.setattr(gemv, "tuned_configs", lambda: table)
    monkeypatch.setattr(gemv, "UNTUNED", False)
    assert [gemv.config_for(m, 100, 300) for m in (1, 2, 3, 8, 9)] == [*table[(100, 300)][:1] * 2,
                                                                       *table[(100, 300)][1:] * 2, None]
    assert gemv.config_for(4, 60, 300) == table[(60, 300)][0] and gemv.config_for(5, 60, 300) is None
    assert gemv.config_for(1, 50, 300) is None and gemv.config_for(1, 1, 1) is None
    assert gemv.is_tuned(100, 300) and gemv.is_tuned(60, 300) and not gemv.is_tuned(50, 300)
    # untuned shapes: the heuristic row loop up to untuned_max_m tokens; an entry without configs stays cuBLAS
    monkeypatch.setattr(gemv, "UNTUNED", True)
    dev = torch.device(DEVICE)
    assert [gemv.config_for(m, 1, 1, dev) for m in (1, 2, 3)] == [gemv.untuned_config(1, 1, dev)] * 2 + [None]
    assert gemv.untuned_config(1, 1, dev).max_m == 2
    # where cuBLAS won on the H200: two tokens only for weights up to 4096 x 2048, none for rows past 8192
    big, long = (4096, 4096), (4096, 12288)
    assert [gemv.config_for(m, *big, dev) for m in (1, 2)] == [gemv.untuned_config(*big, dev), None]
    assert gemv.untuned_config(*big, dev).max_m == 1 and gemv.untuned_max_m(4096, 2048) == 2
    assert gemv.config_for(1, *long, dev) is None and not gemv.serves(*long) and gemv.serves(*big)
    assert gemv.config_for(1, 50, 300, dev) is None and gemv.config_for(1, 70, 300, dev) is None
    assert gemv.config_for(1, 100, 300, dev) == table[(100, 300)][0]
    assert gemv.serves(1, 1) and gemv.serves(100, 300) and not gemv.serves(50, 300)
    for bad in ([{"N": 100}], [{"N": 1, "K": 3, "config": {**loop, "max_m": 5}}],
                [{"N": 1, "K": 3, "configs": [loop, loop]}], [{"N": 1, "K": 3, "configs": [{**dot, "block_n": 8}]}]):
        _write_table(path, bad)
        with pytest.raises(ValueError, match="bad GEMV config file"):
            load_tuned_configs(path)


def test_linear_routes_only_tuned_cuda_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear()` calls the op only for a CUDA bf16/fp16 weight whose (N, K) has a config (on CPU: plain F.linear);
    the op then runs the GEMV up to the config's max_m and cuBLAS above it."""
    x, w, b = _data(3, 24, 40, torch.bfloat16, seed=4, bias=True)
    table = {(24, 40): (GemvConfig(4, 32, 1, max_m=2),)}
    monkeypatch.setattr(gemv, "tuned_configs", lambda: table)
    monkeypatch.setattr(gemv, "UNTUNED", False)
    assert gemv.is_tuned(24, 40) and not gemv.is_tuned(24, 39)
    assert gemv.routes_to_gemv(w) == (DEVICE == "cuda")
    assert not gemv.routes_to_gemv(w.float()) and not gemv.routes_to_gemv(w[:, :39])
    monkeypatch.setattr(gemv, "ENABLED", False)
    assert not gemv.routes_to_gemv(w)
    torch.testing.assert_close(linear_mod.linear(x, w, b), F.linear(x, w, b))
    if DEVICE == "cuda":
        monkeypatch.setattr(gemv, "ENABLED", True)
        assert torch.equal(linear_mod.linear(x[:2], w, b), gemv_triton(x[:2], w, b, table[(24, 40)][0]))
        assert torch.equal(linear_mod.linear(x, w, b), F.linear(x, w, b))  # M = 3 > max_m


def test_linear_routes_untuned_shapes_to_the_heuristic_row_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRAPHRUNNER_GEMV_UNTUNED (on by default): a CUDA bf16/fp16 weight whose (N, K) the table does not list runs
    default_config's row loop up to untuned_max_m tokens and cuBLAS above; a listed shape without configs stays
    on cuBLAS; with the switch off nothing untuned routes."""
    x, w, b = _data(3, 37, 70, torch.bfloat16, seed=5, bias=True)
    monkeypatch.setattr(gemv, "tuned_configs", lambda: {(37, 71): ()})
    monkeypatch.setattr(gemv, "UNTUNED", True)
    assert gemv.routes_to_gemv(w) == (DEVICE == "cuda")
    assert not gemv.serves(37, 71)
    config = gemv.untuned_config(37, 70, torch.device(DEVICE))
    assert dataclasses.replace(config, max_m=gemv.MAX_M) == gemv.default_config(37, 70, torch.device(DEVICE))
    assert config.max_m == 2
    if DEVICE == "cuda":
        for m in (1, 2):
            assert torch.equal(linear_mod.linear(x[:m], w, b), gemv_triton(x[:m], w, b, config))
        assert torch.equal(linear_mod.linear(x, w, b), F.linear(x, w, b))  # M = 3 > untuned_max_m
    monkeypatch.setattr(gemv, "UNTUNED", False)
    assert not gemv.routes_to_gemv(w) and not gemv.serves(37, 70)


def test_table_read_from_file_is_a_trace_time_constant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fullgraph torch.compile over code asking is_tuned: the file is read outside the trace, the answer baked in."""
    path = tmp_path / "gemv_configs.json"
    _write_table(path, [{"N": 24, "K": 40, "configs": [{"block_n": 4, "block_k": 32}]}])
    monkeypatch.setenv("GRAPHRUNNER_GEMV_CONFIGS", str(path))
    gemv.tuned_configs.cache_clear()
    try:
        def f(x: torch.Tensor) -> torch.Tensor:
            return x * 2 if gemv.is_tuned(24, 40) else x * 3

        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    finally:
        gemv.tuned_configs.cache_clear()


def test_custom_op_falls_back_and_passes_opcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = _data(gemv.MAX_M + 1, 24, 40, torch.bfloat16, seed=4, bias=True)
    assert torch.equal(torch.ops.graphrunner.small_m_linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(gemv, "tuned_configs", lambda: {(24, 40): (GemvConfig(8, 32, 2),)})
    x32 = x[:3].float()  # float32 never reaches the kernel
    assert torch.equal(torch.ops.graphrunner.small_m_linear(x32, w.float(), None), F.linear(x32, w.float()))
    small = _data(3, 24, 40, torch.float16, seed=5, bias=True)
    torch.testing.assert_close(torch.ops.graphrunner.small_m_linear(*small), gemv_ref(*small), **TOL[torch.float16])
    torch.library.opcheck(torch.ops.graphrunner.small_m_linear.default, small,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_gpu_split_k_under_load_and_batch_invariant() -> None:
    """Many tiles x splits racing on the counters, repeated: every result equals the first, is close to the
    reference, and each row equals itself computed alone."""
    x, w, b = _data(8, 4096, 3072, torch.bfloat16, seed=8, bias=True)
    for cfg in (GemvConfig(16, 128, 8), GemvConfig(4, 512, 2), GemvConfig(2, 1024, 1, num_warps=8),
                GemvConfig(32, 256, 2, use_dot=True), GemvConfig(64, 512, 4, use_dot=True, swap_ab=True)):
        expected = gemv_triton(x, w, b, cfg)
        torch.testing.assert_close(expected, gemv_ref(x, w, b), **TOL[torch.bfloat16])
        for _ in range(100):
            assert torch.equal(gemv_triton(x, w, b, cfg), expected)
        for m in range(1, 8):
            assert torch.equal(gemv_triton(x[:m], w, b, cfg), expected[:m]), (cfg, m)


def test_op_traces_with_dynamic_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """fullgraph torch.compile (aot_eager: Dynamo + AOTAutograd over the fake impl) with a symbolic M."""
    monkeypatch.setattr(gemv, "tuned_configs", lambda: {(24, 40): (GemvConfig(8, 32, 2),)})

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(torch.ops.graphrunner.small_m_linear(x, w, b)) * 2

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (2, 3, 9):  # the GEMV twice on CUDA (one trace), then cuBLAS/F.linear at run time, same graph
        x, w, b = _data(m, 24, 40, torch.float16, seed=m, bias=True)
        expected = F.silu(gemv_ref(x, w, b) if m <= gemv.MAX_M else F.linear(x, w, b)) * 2
        torch.testing.assert_close(compiled(x, w, b), expected, **TOL[torch.float16])


def test_sweep_plan_picks_the_cheapest_split_between_kernels() -> None:
    """tools/bench_kernels.choose_plan: the row loop, tensor cores and cuBLAS each serve a power-of-two range of M,
    whichever totals least; none where cuBLAS wins everywhere."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_kernels import choose_plan

    ms = [1, 2, 4, 8]
    flat = {m: 5.0 for m in ms}
    assert choose_plan(ms, flat, {1: 4, 2: 6, 4: 8, 8: 12}, {2: 4, 4: 4.5, 8: 5.5}) == (1, 4)
    assert choose_plan(ms, {1: 12.7, 2: 10.3, 4: 10.5, 8: 5.9}, {1: 3.3, 2: 3.9, 4: 5, 8: 7.2}, {}) == (4, 4)
    assert choose_plan(ms, flat, {m: 6.0 for m in ms}, {m: 6.0 for m in ms}) == (0, 0)
    assert choose_plan(ms, flat, {m: 9.0 for m in ms}, {m: 1.0 for m in ms}) == (0, 8)


NORM_CASES = [  # m, n, k, config
    (1, 37, 50, GemvConfig(4, 16, 1)),
    (3, 30, 300, GemvConfig(2, 128, 2)),  # split-K: every split computes the whole row's statistics
    (8, 33, 1030, GemvConfig(8, 256, 1, num_warps=8)),
    (5, 64, 200, GemvConfig(16, 64, 2, use_dot=True)),
    (6, 40, 200, GemvConfig(16, 64, 2, use_dot=True, swap_ab=True)),
]


@pytest.mark.parametrize(("m", "n", "k", "config"), NORM_CASES)
def test_norm_prologue_matches_rms_norm_then_linear(m: int, n: int, k: int, config: GemvConfig) -> None:
    from graphrunner.models.norm import rms_norm

    for dtype in DOT_DTYPES if config.use_dot else (torch.bfloat16, torch.float16):
        x, w, b = _data(m, n, k, dtype, seed=m + n, bias=True)
        x = x * 4  # rms far from 1: the normalisation matters
        nw = (torch.rand(k, generator=torch.Generator().manual_seed(k)) + 0.5).to(dtype).to(DEVICE)
        got = gemv_triton(x, w, b, config, norm=(nw, 1e-6))
        torch.testing.assert_close(got, gemv_ref(rms_norm(x, nw, 1e-6), w, b), **TOL[dtype])
        for rows in (1, m):  # rows bit-equal whatever M
            assert torch.equal(gemv_triton(x[:rows], w, b, config, norm=(nw, 1e-6)), got[:rows])


def test_rms_norm_triton_matches_reference() -> None:
    from graphrunner.models.norm import rms_norm, rms_norm_triton

    for t, d in ((0, 16), (1, 1), (5, 1000), (3, 1024)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(t, d, generator=torch.Generator().manual_seed(d)) * 3).to(dtype).to(DEVICE)
            w = (torch.rand(d, generator=torch.Generator().manual_seed(t)) + 0.5).to(dtype).to(DEVICE)
            tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else TOL[dtype]
            torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm(x, w, 1e-6), **tol)
    with pytest.raises(ValueError, match="does not match weight"):
        rms_norm_triton(torch.zeros(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-6)


def test_norm_linear_routing_and_op_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_linear is exactly rms_norm then linear unless GRAPHRUNNER_GEMV_NORM routes it (CUDA, tuned weight); the
    op falls back to the norm and F.linear where no config serves M, and passes opcheck."""
    from graphrunner.models.norm import rms_norm

    x, w, b = _data(3, 24, 40, torch.bfloat16, seed=6, bias=True)
    nw = (torch.rand(40, generator=torch.Generator().manual_seed(1)) + 0.5).to(torch.bfloat16).to(DEVICE)
    expected = F.linear(rms_norm(x, nw, 1e-6), w, b)
    monkeypatch.setattr(gemv, "tuned_configs", lambda: {(24, 40): (GemvConfig(4, 32, 1, max_m=2),)})
    for flag in (False, True):
        monkeypatch.setattr(gemv, "NORM_PROLOGUE", flag)
        assert torch.equal(linear_mod.norm_linear(x, nw, 1e-6, w, b), expected)  # M = 3 > max_m, or off, or CPU
    op = torch.ops.graphrunner.small_m_norm_linear
    torch.testing.assert_close(op(x, nw, 1e-6, w, b), expected, **TOL[torch.bfloat16])
    if DEVICE == "cuda":  # M = 2: the prologue
        assert torch.equal(op(x[:2], nw, 1e-6, w, b),
                           gemv_triton(x[:2], w, b, GemvConfig(4, 32, 1, max_m=2), norm=(nw, 1e-6)))
    torch.library.opcheck(op.default, (x, nw, 1e-6, w, b), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", ["GRAPHRUNNER_GEMV", "GRAPHRUNNER_GEMV_NORM", "GRAPHRUNNER_PDL"])
def test_bad_switch_values_are_refused(name: str) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, name: "yes"}
    got = subprocess.run([sys.executable, "-c", "import graphrunner.models.gemv"], env=env, capture_output=True,
                         text=True, check=False, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert got.returncode != 0 and f"{name} must be one of 0, 1" in got.stderr, got.stderr


def test_few_program_sweep_space_times_only_what_the_default_space_leaves_out() -> None:
    """tools/bench_kernels._sweep_dot_configs(space="few"): tensor-core shapes of one program per SM down to a quarter
    of the SMs (the 0.6B o and down projections have 64 N tiles of 16: none of them in the default space, which wants
    a program per two SMs), valid configs, and none the default space already times."""
    from tests.tool_loader import load_tool

    sweep = load_tool("bench_kernels")._sweep_dot_configs
    for n, k in ((1024, 2048), (1024, 3072), (4096, 1024), (6144, 1024)):
        many, few = sweep(n, k, 132), sweep(n, k, 132, "few")
        assert few and not set(few) & set(many), (n, k)
        for c in few:
            programs = triton.cdiv(n, c.block_n) * c.split_k
            assert 132 <= 4 * programs <= 4 * 132 and c.use_dot and c.split_k <= 4 and c.num_stages in (3, 4), c
            assert c.block_n * c.block_k >= 4096 and (c.num_warps < 4 or 2 * programs < 132), c
    for c in (GemvConfig(16, 512, 1, num_warps=4, num_stages=4, use_dot=True, swap_ab=True),  # whole K, 64 programs
              GemvConfig(64, 256, 4, num_warps=4, num_stages=3, use_dot=True, swap_ab=True)):  # o's M = 8 row
        assert c in sweep(1024, 2048, 132, "few"), c


def test_sweep_shapes_take_name_parts_and_explicit_weights() -> None:
    """tools/bench_kernels.select_shapes: a name part picks 0.6B shapes, "NxK" any weight (the trained spec target's
    layers are not 0.6B's), and a part that matches nothing is refused by name instead of sweeping nothing."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_kernels import QWEN3_06B_SHAPES, select_shapes

    assert select_shapes("") == QWEN3_06B_SHAPES
    assert select_shapes("o 2048, 2048x1024") == {"o 2048->1024": (1024, 2048), "2048x1024": (2048, 1024)}
    with pytest.raises(SystemExit, match="'qvk'"):
        select_shapes("qkv,qvk")
    # a model's own layers (the demo model: hidden 256, 8 heads of 64, 4 KV heads, intermediate 768, vocab 4096)
    demo = Path(__file__).resolve().parents[1] / "graphrunner" / "demo_model"
    assert sorted(select_shapes(f"model:{demo}").values()) == [(256, 512), (256, 768), (1024, 256), (1536, 256),
                                                                (4096, 256)]
    with pytest.raises(SystemExit, match="cannot read the layer shapes"):
        select_shapes(f"model:{demo / 'missing'}")


def test_is_tuned_is_marked_constant_as_torch_marks_it() -> None:
    """gemv.is_tuned sets the attribute torch.compiler.assume_constant_result sets (importing Dynamo, which an
    uncompiled engine never does, would cost seconds at start-up): torch must still mark functions that way."""

    def probe(n: int, k: int) -> bool:
        return n > k

    marked = torch.compiler.assume_constant_result(probe)
    added = set(vars(marked)) - {"__wrapped__"}
    assert added == {"_dynamo_marked_constant"} and marked._dynamo_marked_constant is True
    assert gemv.is_tuned._dynamo_marked_constant is True  # type: ignore[attr-defined]
    assert gemv.serves._dynamo_marked_constant is True  # type: ignore[attr-defined]
