"""The uncompiled engine's eager shortcuts: rope's one-gather lookup from a pre-cast table, and RMSNorm in one Triton
launch on CUDA. Each must give exactly what the traced form gives (the form Inductor fuses), which stays the
reference."""

from __future__ import annotations

import pytest
import torch

from graphrunner.config import RopeConfig
from graphrunner.models import norm as norm_mod
from graphrunner.models.rotary import RotaryEmbedding


def _traced_lookup(rope: RotaryEmbedding, positions: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What forward returns while torch.compile traces: gather from the float32 tables, then cast."""
    cos = rope.cos_cache.index_select(0, positions).to(dtype)
    sin = rope.sin_cache.index_select(0, positions).to(dtype)
    return cos.unsqueeze(1), sin.unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [0, 1, 7, 130])
def test_rope_lookup_from_the_cast_table_is_bit_equal(dtype: torch.dtype, t: int) -> None:
    rope = RotaryEmbedding(head_dim=18, max_positions=333, rope=RopeConfig(theta=10000.0))
    positions = torch.randint(0, 333, (t,), generator=torch.Generator().manual_seed(t))
    cos, sin = rope(positions, dtype)
    want_cos, want_sin = _traced_lookup(rope, positions, dtype)
    assert cos.shape == sin.shape == (t, 1, 9) and cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.stride(-1) == sin.stride(-1) == 1  # what the fused q/k prologue kernel needs


def test_rope_cast_table_is_rebuilt_after_reset_and_kept_per_dtype() -> None:
    rope = RotaryEmbedding(head_dim=8, max_positions=16, rope=RopeConfig(theta=10000.0))
    positions = torch.arange(16)
    rope(positions, torch.bfloat16)
    rope(positions, torch.float16)
    assert len(rope._tables) == 2
    rope.rope = RopeConfig(theta=500.0)  # a different table: reset_buffers must drop the cast copies
    rope.reset_buffers()
    cos, _ = rope(positions, torch.bfloat16)
    assert torch.equal(cos, _traced_lookup(rope, positions, torch.bfloat16)[0])


def test_rope_lookup_while_traced_keeps_the_fusable_form() -> None:
    """Under torch.compile the lookup is the two gathers and casts (Inductor fuses them), and no table is built."""
    rope = RotaryEmbedding(head_dim=8, max_positions=32, rope=RopeConfig(theta=10000.0))
    positions = torch.tensor([3, 0, 31, 3])
    compiled = torch.compile(lambda p: rope(p, torch.bfloat16), backend="eager", fullgraph=True)
    cos, sin = compiled(positions)
    want_cos, want_sin = _traced_lookup(rope, positions, torch.bfloat16)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope._tables == {}


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
