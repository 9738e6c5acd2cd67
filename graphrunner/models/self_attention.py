"""The self-attention block of a decoder layer: fused QKV projection (optional bias), optional
per-head q/k RMSNorm (Qwen3), rotary embedding, paged attention and the output projection.

Parameter names follow HF (`qkv_proj` fuses `q_proj`/`k_proj`/`v_proj`; `q_norm`, `k_norm`, `o_proj`).
With tensor parallelism each rank holds its query heads and KV heads (one replicated KV head when there are
fewer KV heads than ranks) and o_proj all-reduces.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrunner.attention import Attention
from graphrunner.models import qkv_partials, qkv_prep
from graphrunner.models.norm import RMSNorm
from graphrunner.models.parallel_linear import RowParallelLinear, ShardedMergedLinear
from graphrunner.models.rotary import apply_rotary
from graphrunner.parallel_state import kv_head_range, shard_range


class SelfAttention(nn.Module):
    """q/k/v from one matmul; rope is applied with cos/sin computed once per forward by the model."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        scale: float,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        q_start, self.num_heads = shard_range(num_heads)  # this rank's heads
        kv_start, self.num_kv_heads = kv_head_range(num_kv_heads)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        kv_piece = (kv_start * head_dim, self.kv_size)
        self.qkv_proj = ShardedMergedLinear(hidden_size, [(q_start * head_dim, self.q_size), kv_piece, kv_piece],
                                            bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale, layer_idx, sliding_window=sliding_window)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                norm: RMSNorm | None = None) -> torch.Tensor:
        """hidden [T, hidden], cos/sin [T, 1, D/2] -> [T, hidden]; `norm`: the layer's input norm, applied here
        (models.linear.norm_linear may fold it into the QKV projection)."""
        return self.o_proj(self.attend(hidden, cos, sin, norm))

    def attend(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               norm: RMSNorm | None = None) -> torch.Tensor:
        """forward without o_proj: the attention output [T, Hq*D] (the decoder may fold o_proj into the add + norm
        after it, o_proj.forward_add_norm)."""
        t = hidden.shape[0]
        proj = self.qkv_proj
        if qkv_prep.FUSED_QKV_PREP and norm is None and qkv_partials.routes(hidden, proj.weight):
            # the GEMV may leave its split-K partials for the prologue to sum (qkv then unwritten)
            qkv, parts = qkv_partials.qkv_projection(hidden, proj.weight, proj.bias)
            return self._fused_attention(qkv, cos, sin, parts, hidden.shape[1])
        qkv = proj(hidden) if norm is None else proj.forward_normed(hidden, norm)  # [T, (Hq+2Hkv)D]
        if qkv_prep.FUSED_QKV_PREP:  # q/k norm, rope and the cache write in one kernel
            return self._fused_attention(qkv, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # unflatten / clone rather than reshape / contiguous: on the strided split those ask whether T == 1,
        # and torch.compile would then trace a second graph for one-token steps (capture/compiled.py)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # [T, Hq, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin).reshape(t, self.q_size)  # [T, Hq*D]
        k = apply_rotary(k, cos, sin).reshape(t, self.kv_size)  # [T, Hkv*D]
        return self.attn(q, k, v.clone(memory_format=torch.contiguous_format))  # [T, Hq*D]

    def _fused_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         parts: torch.Tensor | None = None, k: int = 0) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] (or its projection's partials: qkv_partials.qkv_projection, input width k) ->
        attention output [T, Hq*D] through graphrunner::paged_attention_qkv."""
        attn = self.attn
        normed = self.q_norm is not None and self.k_norm is not None
        out = qkv.new_empty(qkv.shape[0], self.q_size)  # [T, Hq*D]
        qkv_prep.paged_attention_qkv(
            qkv, cos, sin, self.q_norm.weight if normed else None, self.k_norm.weight if normed else None,
            self.q_norm.eps if normed else 0.0, out, attn.layer_idx, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, attn.scale, -1 if attn.sliding_window is None else attn.sliding_window, parts,
            self.qkv_proj.bias if parts is not None else None, k)
        return out
