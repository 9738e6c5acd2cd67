"""The eager forms of the two ops Inductor would otherwise fuse (what the uncompiled engine runs, and what a trace
for the eager piece compiler records): rope's cos/sin lookup in one Triton launch, and RMSNorm in one Triton launch,
on CUDA. The kernel gives exactly what the traced form gives (the form Inductor fuses), which stays the reference;
a trace for Inductor keeps that form, and a trace without fusion records the ops."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from graphrunner.config import RopeConfig
from graphrunner.models import norm as norm_mod
from graphrunner.models.rotary import RotaryEmbedding, rope_cos_sin_ref, rope_cos_sin_triton
from graphrunner.opaque import trace_without_fusion

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _traced_lookup(rope: RotaryEmbedding, positions: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What forward returns while torch.compile traces for Inductor: gather from the float32 tables, then cast."""
    cos = rope.cos_cache.index_select(0, positions).to(dtype)
    sin = rope.sin_cache.index_select(0, positions).to(dtype)
    return cos.unsqueeze(1), sin.unsqueeze(1)


# bf16 only on CUDA: the interpreter's bf16 cast may not round to nearest even
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "half", "positions"), [(0, 9, 333), (1, 1, 5), (7, 9, 333), (130, 64, 4096),
                                                      (3, 3, 3)])
def test_rope_kernel_matches_reference(dtype: torch.dtype, t: int, half: int, positions: int) -> None:
    g = torch.Generator().manual_seed(t * 7 + half)
    cos = torch.randn(positions, half, generator=g).to(DEVICE)
    sin = torch.randn(positions, half, generator=g).to(DEVICE)
    pos = torch.randint(0, positions, (t,), generator=g).to(DEVICE)
    got = rope_cos_sin_triton(cos, sin, pos, dtype)
    want = rope_cos_sin_ref(cos, sin, pos, dtype)
    assert got.shape == (t, 2 * half) and got.dtype == dtype
    assert torch.equal(got, want)


def test_rope_kernel_refuses_bad_input() -> None:
    cos = torch.randn(8, 4, device=DEVICE)
    pos = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="positions must be torch.int64"):
        rope_cos_sin_triton(cos, cos, pos.int(), torch.float32)
    with pytest.raises(ValueError, match="contiguous tables of one shape"):
        rope_cos_sin_triton(cos, cos[:, :2].contiguous(), pos, torch.float32)
    with pytest.raises(ValueError, match="dtype must be"):
        rope_cos_sin_triton(cos, cos, pos, torch.int32)
    with pytest.raises(ValueError, match="cos_cache must be torch.float32"):
        rope_cos_sin_triton(cos.half(), cos.half(), pos, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0, 1, 7, 130])
def test_rope_lookup_is_bit_equal_to_the_traced_form(dtype: torch.dtype, t: int) -> None:
    """On CUDA the forward is the kernel (its two halves as views); on CPU the traced form itself."""
    rope = RotaryEmbedding(head_dim=18, max_positions=333, rope=RopeConfig(theta=10000.0)).to(DEVICE)
    positions = torch.randint(0, 333, (t,), generator=torch.Generator().manual_seed(t)).to(DEVICE)
    cos, sin = rope(positions, dtype)
    want_cos, want_sin = _traced_lookup(rope, positions, dtype)
    assert cos.shape == sin.shape == (t, 1, 9) and cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.stride(-1) == sin.stride(-1) == 1  # what the fused q/k prologue kernel needs


def test_rope_lookup_follows_reset_buffers() -> None:
    rope = RotaryEmbedding(head_dim=8, max_positions=16, rope=RopeConfig(theta=10000.0)).to(DEVICE)
    positions = torch.arange(16, device=DEVICE)
    before, _ = rope(positions, torch.float16)
    rope.rope = RopeConfig(theta=500.0)  # another table: the lookup reads the new one
    rope.reset_buffers()
    cos, _ = rope(positions, torch.float16)
    assert torch.equal(cos, _traced_lookup(rope, positions, torch.float16)[0]) and not torch.equal(cos, before)


def _traced_targets(fn: object, *args: torch.Tensor) -> set[str]:
    targets: set[str] = set()

    def backend(gm: fx.GraphModule, _: list) -> object:
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets


def test_a_trace_for_inductor_keeps_the_fusable_forms() -> None:
    """Under torch.compile (for Inductor) the lookup is the two gathers and casts and the norm its PyTorch form."""
    rope = RotaryEmbedding(head_dim=8, max_positions=32, rope=RopeConfig(theta=10000.0)).to(DEVICE)
    positions = torch.tensor([3, 0, 31, 3], device=DEVICE)
    compiled = torch.compile(lambda p: rope(p, torch.bfloat16), backend="eager", fullgraph=True)
    cos, sin = compiled(positions)
    want_cos, want_sin = _traced_lookup(rope, positions, torch.bfloat16)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    x = torch.randn(4, 16, dtype=torch.bfloat16, device=DEVICE)
    targets = _traced_targets(lambda a, p: (norm_mod.rms_norm_any(a, a[0], 1e-6), rope(p, a.dtype)), x, positions)
    assert not any(t.startswith("graphrunner.") for t in targets), targets


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_trace_without_fusion_records_the_triton_ops() -> None:
    rope = RotaryEmbedding(head_dim=8, max_positions=32, rope=RopeConfig(theta=10000.0)).to("cuda")
    positions = torch.tensor([3, 0, 31, 3], device="cuda")
    x = torch.randn(4, 16, dtype=torch.bfloat16, device="cuda")
    with trace_without_fusion():
        targets = _traced_targets(lambda a, p: (norm_mod.rms_norm_any(a, a[0], 1e-6), rope(p, a.dtype)), x,
                                  positions)
    # Dynamo's graph names an op by its packet (torch 2.11: graphrunner.rms_norm), an exported one by its overload
    ops = {t.removesuffix(".default") for t in targets}
    assert {"graphrunner.rms_norm", "graphrunner.rope_cos_sin"} <= ops, targets


def test_rms_norm_any_on_cpu_is_the_reference() -> None:
    x = torch.randn(5, 37, dtype=torch.bfloat16)
    w = torch.randn(37, dtype=torch.bfloat16)
    assert torch.equal(norm_mod.rms_norm_any(x, w, 1e-6), norm_mod.rms_norm(x, w, 1e-6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,d", [(1, 1024), (7, 37), (130, 2048), (0, 64)])
def test_rms_norm_any_on_cuda_is_one_triton_launch_close_to_the_reference(t: int, d: int) -> None:
    x = torch.randn(t, d, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(d, dtype=torch.bfloat16, device="cuda")
    got = norm_mod.rms_norm_any(x, w, 1e-6)
    assert torch.equal(got, norm_mod.rms_norm_triton(x, w, 1e-6))
    # the float32 sum's order differs from PyTorch's mean: at most one bf16 step apart
    torch.testing.assert_close(got.float(), norm_mod.rms_norm(x, w, 1e-6).float(), rtol=1e-2, atol=1e-2)
