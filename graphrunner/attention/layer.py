"""The attention layer models call: writes this step's K/V into the paged cache, then attends.

The work happens inside one torch custom op, `graphrunner::paged_attention(q, k, v, layer_idx,
...)`, which reads the step's metadata, the KV cache and the backend from the forward context at
run time. The model's forward therefore keeps a plain `(input_ids, positions)` signature, and
torch.compile sees attention as one opaque call per layer: the place where piecewise graphs split.
Backends: the Triton unified kernel (the default on CUDA) and the PyTorch reference (CPU, tests).
"""

from __future__ import annotations

import torch
from torch import nn

from graphrunner.attention.context import ForwardContext, get_forward_context
from graphrunner.attention.decode_prep import DecodePrep
from graphrunner.attention.reference import paged_attention_ref, write_kv_ref
from graphrunner.attention.triton_attention import (
    choose_num_splits,
    query_tiles,
    unified_attention,
    unified_attention_prepped,
    write_kv_triton,
)
from graphrunner.opaque import opaque_op


def attend(ctx: ForwardContext, q3: torch.Tensor, out: torch.Tensor, layer_idx: int, num_heads: int,
           num_kv_heads: int, head_dim: int, scale: float, sliding_window: int) -> None:
    """q3 [T, Hq, D] over the context's cache layer (this step's K/V already written) -> out [T, Hq*D]; shared by
    the attention ops (here and models/qkv_prep.py), which pass in the forward context they already hold."""
    meta = ctx.meta
    layer_cache = ctx.kv_cache[layer_idx]  # [2, num_blocks, block_size, Hkv, D]
    t = q3.shape[0]
    window = None if sliding_window < 0 else sliding_window
    if ctx.backend == "triton":
        unified_attention(q3, layer_cache, meta, scale, window, num_splits=_num_splits(ctx, num_heads, num_kv_heads),
                          out=out.view(t, num_heads, head_dim))
    else:
        out.view(t, num_heads, head_dim).copy_(paged_attention_ref(q3, layer_cache, meta, scale, window))


def attend_prepped(ctx: ForwardContext, prep: DecodePrep, out: torch.Tensor, layer_idx: int, num_heads: int,
                   num_kv_heads: int, head_dim: int, scale: float, sliding_window: int) -> None:
    """attend() for a decode step on the Triton backend from the un-normed, un-roped projection: the kernel runs the
    attention prologue itself and writes this step's K/V (decode_prep.py) -> out [T, Hq*D]."""
    t = prep.qkv.shape[0]
    unified_attention_prepped(prep, ctx.kv_cache[layer_idx], ctx.meta, scale,
                              None if sliding_window < 0 else sliding_window,
                              _num_splits(ctx, num_heads, num_kv_heads), out.view(t, num_heads, head_dim))


def _num_splits(ctx: ForwardContext, num_heads: int, num_kv_heads: int) -> int:
    """The step's KV split count: one choice per step, shared by every layer (a captured graph sets its own)."""
    meta = ctx.meta
    splits = meta.backend_cache.get("num_splits")
    if splits is None:
        tiles = meta.num_reqs * query_tiles(meta.max_query_len, num_heads // num_kv_heads)
        splits = choose_num_splits(tiles, num_kv_heads, meta.max_seq_len)
        meta.backend_cache["num_splits"] = splits
    return splits


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_idx: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int) -> None:
    """q [T, Hq*D], k/v [T, Hkv*D] -> out [T, Hq*D]; writes k/v into layer `layer_idx` of the context's cache.

    `out` is allocated by the caller so that, under piecewise CUDA graphs, it lives in the graph of
    the piece before this call and the piece after reads it at a fixed address. sliding_window -1 =
    none. The cache write is a side effect on context state the compiler never sees; layers stay
    ordered because each layer's input depends on the previous one's output. Traced, this is the opaque op
    graphrunner::paged_attention, where the piecewise backend splits (graphrunner/opaque.py).
    """
    if torch.compiler.is_compiling():
        torch.ops.graphrunner.paged_attention(q, k, v, out, layer_idx, num_heads, num_kv_heads, head_dim, scale,
                                              sliding_window)
    else:
        _paged_attention(q, k, v, out, layer_idx, num_heads, num_kv_heads, head_dim, scale, sliding_window)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_idx: int,
                     num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int) -> None:
    ctx = get_forward_context()
    t = q.shape[0]
    k3 = k.view(t, num_kv_heads, head_dim)
    v3 = v.view(t, num_kv_heads, head_dim)
    write_kv = write_kv_triton if ctx.backend == "triton" else write_kv_ref
    write_kv(k3, v3, ctx.kv_cache[layer_idx], ctx.meta.slot_mapping)
    attend(ctx, q.view(t, num_heads, head_dim), out, layer_idx, num_heads, num_kv_heads, head_dim, scale, sliding_window)


@opaque_op("paged_attention", _paged_attention, mutates_args=("out",)).register_fake
def _(*args: object) -> None:
    return None


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
        window = -1 if self.sliding_window is None else self.sliding_window
        out = torch.empty_like(q)  # [T, Hq*D]
        paged_attention(q, k, v, out, self.layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                        window)
        return out
