"""The attention prologue of a decode step folded into the attention kernel (GRAPHRUNNER_ATTN_DECODE_PREP=1): each
program norms and ropes its query rows straight from the fused qkv projection, and the program whose KV split holds
the new position also computes that token's key and value, writes them into the cache and uses them from registers.
What models/qkv_prep.py's kernel does in a launch of its own; this module holds the arguments and the row math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphrunner.env import env_choice

# Off until measured on the H200 (docs/DECISIONS.md, thirty-second session): one launch fewer per layer in a decode
# step, for a longer attention prologue.
DECODE_PREP = env_choice("GRAPHRUNNER_ATTN_DECODE_PREP", ("0", "1"), "0") == "1"


@dataclass(frozen=True)
class DecodePrep:
    """A decode step's un-normed, un-roped projection and what the prologue needs to finish it."""
    qkv: torch.Tensor             # [T, (Hq + 2 Hkv) D], unit stride in the last dimension
    cos: torch.Tensor             # [T, 1, D/2] in qkv's dtype, unit stride in the last dimension
    sin: torch.Tensor             # [T, 1, D/2]
    q_norm: torch.Tensor | None   # [D] per-head RMSNorm weights (Qwen3), or None with k_norm
    k_norm: torch.Tensor | None   # [D]
    eps: float
    slot_mapping: torch.Tensor    # [T] int64, -1 = padding (no cache write)

    def __post_init__(self) -> None:
        check_projection_layout(self.qkv, self.cos, self.sin, self.q_norm, self.k_norm)

    def check(self, num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """ValueError naming the first tensor that does not fit a step of num_tokens with these heads."""
        if self.qkv.shape[0] != num_tokens:
            raise ValueError(f"qkv holds {self.qkv.shape[0]} tokens, the step {num_tokens}")
        check_projection_shapes(self.qkv, self.cos, self.sin, num_heads, num_kv_heads, head_dim)
        if self.slot_mapping.shape[0] < num_tokens:
            raise ValueError(f"slot_mapping holds {self.slot_mapping.shape[0]} slots for {num_tokens} tokens")


def check_projection_layout(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                            k_norm: torch.Tensor | None) -> None:
    """The attention prologue's inputs (this module's and models/qkv_prep.py's kernel): norms both or neither, unit
    strides where the kernels read rows."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (both or neither)")
    if qkv.stride(1) != 1 or cos.stride(2) != 1 or sin.stride(2) != 1:
        raise ValueError("qkv, cos and sin need a unit stride in their last dimension")


def check_projection_shapes(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> None:
    """qkv [T, (Hq + 2 Hkv) D] with D even, cos / sin [T, 1, D/2]; ValueError naming the one that is not."""
    t, width = qkv.shape[0], (num_heads + 2 * num_kv_heads) * head_dim
    if head_dim % 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [{t}, {width}]: it does not hold {num_heads} q + 2 x "
                         f"{num_kv_heads} kv heads of even dim {head_dim}")
    if cos.shape != (t, 1, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [{t}, 1, {head_dim // 2}], got {tuple(cos.shape)} / {tuple(sin.shape)}")


@triton.jit
def prep_rows(src, w_ptr, cos_row, sin_row, ok, d, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Heads normed (HF's RMSNorm: float32 statistics, cast back, times the weight; HAS_NORM) and rotated (neox
    halves), in src's dtype: src [R, 1] pointers to each head's first element, cos_row / sin_row [R, 1] pointers to
    its token's cos / sin rows, ok [R, 1] the rows to read, d [D_PAD] -> [R, D_PAD], zero past HEAD_DIM.
    qkv_prep's kernel computes the same per half (x1, x2); here each lane also loads its partner in the other half."""
    half: tl.constexpr = HEAD_DIM // 2
    dd = d[None, :]
    first = dd < half
    partner = tl.where(first, dd + half, dd - half)
    m = ok & (dd < HEAD_DIM)
    x = tl.load(src + dd, mask=m, other=0.0)
    xp = tl.load(src + partner, mask=m, other=0.0)
    if HAS_NORM:
        f, fp = x.to(tl.float32), xp.to(tl.float32)
        inv = tl.rsqrt(tl.sum(f * f, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + dd, mask=dd < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dd < HEAD_DIM, other=0.0).to(tl.float32)
        x = (w * (f * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
        xp = (wp * (fp * inv).to(xp.dtype).to(tl.float32)).to(xp.dtype)
    c = tl.load(cos_row + dd % half, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_row + dd % half, mask=m, other=0.0).to(tl.float32)
    a, b = x.to(tl.float32), xp.to(tl.float32)
    return tl.where(first, a * c - b * s, a * c + b * s).to(x.dtype)
