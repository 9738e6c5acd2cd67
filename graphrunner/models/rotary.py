"""Rotary position embedding (neox / HF `rotate_half` layout) with a precomputed cos/sin cache.

Frequencies: 'default' and Llama-3 ('llama3') scaling, computed exactly as transformers does, so
fp32 results match HF bit for bit. The cache is a non-persistent buffer; call `reset_buffers()`
after materialising a module built on the meta device (the loader does this).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from graphrunner.config import RopeConfig


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
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
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
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # _cast_table's, by dtype and device

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, 1, D/2] in `dtype` (HF casts cos/sin to x.dtype)."""
        table = None if torch.compiler.is_compiling() else self._cast_table(dtype)
        if table is None:  # traced: Inductor fuses the two gathers and casts into one kernel
            cos = self.cos_cache.index_select(0, positions).to(dtype)
            sin = self.sin_cache.index_select(0, positions).to(dtype)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        # eager (an uncompiled engine): one gather from the table cast beforehand, which is bit-equal, since a cast
        # of each element commutes with the gather
        both = table.index_select(0, positions).unsqueeze(1)  # [T, 1, D] cos | sin
        half = self.head_dim // 2
        return both[..., :half], both[..., half:]

    def _cast_table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[P, D] cos | sin in `dtype` on the cache's device, built on first use; None while a CUDA graph is being
        captured and it is not built yet (an allocation there would live in the graph's memory pool)."""
        device = self.cos_cache.device
        table = self._tables.get((dtype, device))
        if table is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            table = torch.cat((self.cos_cache, self.sin_cache), dim=-1).to(dtype)
            self._tables[(dtype, device)] = table
        return table

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, rope={self.rope}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, 1, D/2] -> [T, H, D]; equals HF's x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
