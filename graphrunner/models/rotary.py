"""Rotary position embedding (neox / HF `rotate_half` layout) with a precomputed cos/sin cache.

Frequencies: 'default' and Llama-3 ('llama3') scaling, computed exactly as transformers does, so
fp32 results match HF bit for bit. The cache is a non-persistent buffer; call `reset_buffers()`
after materialising a module built on the meta device (the loader does this). On CUDA the lookup is one
Triton launch (`rope_cos_sin_triton`, next to its reference), except in a trace for Inductor, which fuses the
reference's gathers and casts itself.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import nn

from graphrunner.config import RopeConfig
from graphrunner.kernel_checks import check_tensor, interpreted
from graphrunner.opaque import fusing_trace, opaque_op


def rope_inv_freq(head_dim: int, rope: RopeConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for the given rope parameters."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)  # [D/2] float32
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope.rope_type!r}; supported: 'default', 'llama3'")
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for token positions and rotates query/key heads in place of HF's rotate_half."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        half = head_dim // 2
        self.register_buffer("cos_cache", torch.empty(max_positions, half), persistent=False)  # [P, D/2] f32
        self.register_buffer("sin_cache", torch.empty(max_positions, half), persistent=False)  # [P, D/2] f32
        if self.cos_cache.device.type != "meta":
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin tables in float32 on the buffers' current device."""
        device = self.cos_cache.device
        inv_freq = rope_inv_freq(self.head_dim, self.rope, device)  # [D/2] float32
        pos = torch.arange(self.max_positions, dtype=torch.int64, device=device).to(torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2] float32, same product as HF
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, 1, D/2] in `dtype` (HF casts cos/sin to x.dtype)."""
        if positions.device.type == "cuda" and not fusing_trace() and not interpreted():
            both = (torch.ops.graphrunner.rope_cos_sin(self.cos_cache, self.sin_cache, positions, dtype)
                    if torch.compiler.is_compiling() else rope_cos_sin_triton(self.cos_cache, self.sin_cache,
                                                                              positions, dtype))  # [T, D]
            half = self.head_dim // 2
            return both[:, None, :half], both[:, None, half:]
        # traced for Inductor (which fuses the two gathers and casts into one kernel), CPU, Triton's interpreter
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, rope={self.rope}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] -> [T, H, D]; equals HF's x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_cos_sin_ref(cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """PyTorch reference: cos | sin rows of the positions [T] int64 from the float32 tables [P, D/2], cast to dtype
    (one cast per element, as HF casts cos/sin): [T, D]."""
    return torch.cat((cos_cache.index_select(0, positions), sin_cache.index_select(0, positions)), dim=-1).to(dtype)


@triton.jit
def _rope_cos_sin_kernel(cos_ptr, sin_ptr, pos_ptr, out_ptr, HALF, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=mask)
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=mask)
    row = out_ptr + t * 2 * HALF
    tl.store(row + offs, cos.to(out_ptr.dtype.element_ty), mask=mask)  # round to nearest even, as .to(dtype)
    tl.store(row + HALF + offs, sin.to(out_ptr.dtype.element_ty), mask=mask)


def rope_cos_sin_triton(cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """rope_cos_sin_ref in one launch, a program per token (contiguous tables; positions must be below P, as the
    engine's are: the kernel does not check them)."""
    check_tensor(cos_cache, "cos_cache", torch.float32, 2, None)
    check_tensor(sin_cache, "sin_cache", torch.float32, 2, cos_cache.device)
    check_tensor(positions, "positions", torch.int64, 1, cos_cache.device)
    if sin_cache.shape != cos_cache.shape or not (cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        raise ValueError(f"cos_cache {tuple(cos_cache.shape)} and sin_cache {tuple(sin_cache.shape)} must be "
                         f"contiguous tables of one shape")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rope_cos_sin: dtype must be float32, bfloat16 or float16, got {dtype}")
    half = cos_cache.shape[1]
    out = torch.empty(positions.shape[0], 2 * half, dtype=dtype, device=cos_cache.device)
    if out.numel():
        _rope_cos_sin_kernel[(positions.shape[0],)](cos_cache, sin_cache, positions, out, half,
                                                    BLOCK=triton.next_power_of_2(half), num_warps=1)
    return out


@opaque_op("rope_cos_sin", rope_cos_sin_triton).register_fake
def _(cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cos_cache.new_empty(positions.shape[0], 2 * cos_cache.shape[1], dtype=dtype)
