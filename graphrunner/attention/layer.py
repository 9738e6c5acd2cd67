"""The attention layer models call: writes this step's K/V into the paged cache, then attends.

It reads the step's metadata and the KV cache from the forward context, so the model's forward
keeps a plain `(input_ids, positions)` signature. The backend is the PyTorch reference for now.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrunner.attention.context import get_forward_context
from graphrunner.attention.reference import paged_attention_ref, write_kv_ref


class Attention(nn.Module):
    """Paged multi-head attention with grouped KV heads; q/k/v arrive already projected and roped."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        ctx = get_forward_context()
        layer_cache = ctx.kv_cache[self.layer_idx]  # [2, num_blocks, block_size, Hkv, D]
        t = q.shape[0]
        write_kv_ref(k.view(t, self.num_kv_heads, self.head_dim), v.view(t, self.num_kv_heads, self.head_dim),
                     layer_cache, ctx.meta.slot_mapping)
        out = paged_attention_ref(q.view(t, self.num_heads, self.head_dim), layer_cache, ctx.meta, self.scale,
                                  self.sliding_window)
        return out.reshape(t, self.num_heads * self.head_dim)
