"""Attention's prologue in one kernel: split a token's fused qkv row, apply the optional per-head RMSNorm (Qwen3's
q/k norms), rotate q and k (neox layout) and write k and v into the paged cache at the token's slot; q goes to its
own buffer. It replaces the per-layer norm / rope / copy kernels and `write_kv_triton` (issue 17), behind the op
`graphrunner::paged_attention_qkv`. `qkv_prep_ref` is the PyTorch reference (the models' own RMSNorm and rope).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrunner.attention import decode_prep
from graphrunner.attention.context import get_forward_context
from graphrunner.attention.decode_prep import DecodePrep, check_projection_layout, check_projection_shapes
from graphrunner.attention.layer import attend, attend_prepped
from graphrunner.attention.reference import write_kv_ref
from graphrunner.env import env_choice
from graphrunner.kernel_checks import check_tensor, interpreted
from graphrunner.models import qkv_partials
from graphrunner.models.norm import rms_norm
from graphrunner.models.rotary import apply_rotary
from graphrunner.opaque import opaque_op
from graphrunner.pdl import pdl_enter, pdl_mode, use_pdl

# SelfAttention hands the op below its fused qkv row and q/k norms (on by default since the H200 A/B of
# 2026-12-01: L1 TPOT 1.23 -> 0.96 ms, docs/DECISIONS.md); GRAPHRUNNER_FUSED_QKV_PREP=0 keeps the unfused path.
FUSED_QKV_PREP = env_choice("GRAPHRUNNER_FUSED_QKV_PREP", ("0", "1"), "1") == "1"
# Triton's interpreter runs one program at a time, and the kernel's (token, head) grid made CPU engines on the
# triton backend twice as slow; there engines take the reference unless a test asks for the kernel (test_qkv_prep).
INTERPRETED = interpreted()
KERNEL_UNDER_INTERPRETER = False


def qkv_prep_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D], cos/sin [T, 1, D/2] in qkv's dtype, q_norm/k_norm [D] or None -> q [T, Hq D] roped;
    k (normed, roped) and v written into layer_cache [2, blocks, block_size, Hkv, D] at slot_mapping [T] (-1: skip)."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.unflatten(-1, (num_heads, head_dim))
    k = k.unflatten(-1, (num_kv_heads, head_dim))
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    write_kv_ref(k, v.reshape(t, num_kv_heads, head_dim), layer_cache, slot_mapping)
    return q.reshape(t, q_size)


@triton.jit
def _qkv_prep_kernel(
    qkv_ptr,  # [T, (Hq + 2 Hkv) D]
    q_out_ptr,  # [T, Hq D]
    q_norm_ptr,  # [D] (HAS_NORM)
    k_norm_ptr,  # [D] (HAS_NORM)
    cos_ptr,  # [T, D/2] rows at stride_cos
    sin_ptr,  # [T, D/2] rows at stride_sin
    slot_ptr,  # [T] int64, -1 = padding
    k_cache_ptr,  # [blocks, block_size, Hkv, D]
    v_cache_ptr,
    stride_qkv,
    stride_qo,
    stride_cos,
    stride_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    eps,
    part_ptr,  # [SPLITS, T, (Hq + 2 Hkv) D] float32, contiguous (PARTS)
    bias_ptr,  # [(Hq + 2 Hkv) D] (PARTS and HAS_BIAS)
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (graphrunner.pdl)
    PARTS: tl.constexpr = False,  # the row is the sum of the projection's split-K partials (qkv_partials.py)
    SPLITS: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_PAD)
    mask = offs < half
    # Before the wait: the norm weights (constants), and the slots and cos/sin rows, which non-PDL kernels wrote
    # (prepare, the rope table lookup), so they are final when this kernel starts (graphrunner.pdl). Loaded after the
    # sum of squares' reduction, they were a second memory round trip on the step's critical path.
    rope = h < NUM_HEADS + NUM_KV_HEADS  # q and k heads; v heads are copied as they are
    rope_mask = mask & (offs * 0 + h < NUM_HEADS + NUM_KV_HEADS)  # [HALF_PAD]
    slot = tl.load(slot_ptr + t)
    c = tl.load(cos_ptr + t * stride_cos + offs, mask=rope_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + offs, mask=rope_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w_ptr = q_norm_ptr if h < NUM_HEADS else k_norm_ptr
        w1 = tl.load(w_ptr + offs, mask=rope_mask, other=0.0)
        w2 = tl.load(w_ptr + half + offs, mask=rope_mask, other=0.0)
    if PARTS and HAS_BIAS:  # a constant, like the norm weights
        b1 = tl.load(bias_ptr + h * HEAD_DIM + offs, mask=mask, other=0.0).to(tl.float32)
        b2 = tl.load(bias_ptr + h * HEAD_DIM + half + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # qkv (or its partials) is the previous kernel's output
        pdl_enter(PDL)
    if PARTS:  # the GEMV tail's sum: ((0 + p0) + p1) + ..., then the bias, rounded once
        row_len = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        src = part_ptr + t * row_len + h * HEAD_DIM
        f1 = tl.zeros([HALF_PAD], dtype=tl.float32)
        f2 = tl.zeros([HALF_PAD], dtype=tl.float32)
        for split in tl.static_range(SPLITS):  # (`s` holds the sines)
            f1 += tl.load(src + split * tl.num_programs(0) * row_len + offs, mask=mask, other=0.0)
            f2 += tl.load(src + split * tl.num_programs(0) * row_len + half + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            f1 += b1
            f2 += b2
        x1 = f1.to(q_out_ptr.dtype.element_ty)  # [HALF_PAD] first half of the head
        x2 = f2.to(q_out_ptr.dtype.element_ty)
    else:
        src = qkv_ptr + t * stride_qkv + h * HEAD_DIM
        x1 = tl.load(src + offs, mask=mask, other=0.0)  # [HALF_PAD] first half of the head
        x2 = tl.load(src + half + offs, mask=mask, other=0.0)
    if not rope:  # v: copied as is
        if slot >= 0:
            dst = v_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
                + (h - NUM_HEADS - NUM_KV_HEADS) * stride_ch
            tl.store(dst + offs, x1, mask=mask)
            tl.store(dst + half + offs, x2, mask=mask)
    else:
        if HAS_NORM:  # HF's RMSNorm: float32 statistics, cast back to the input dtype, then times the weight
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
            x1 = (w1.to(tl.float32) * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            x2 = (w2.to(tl.float32) * (f2 * inv).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        r1 = (a * c - b * s).to(x1.dtype)
        r2 = (b * c + a * s).to(x2.dtype)
        if h < NUM_HEADS:
            dst = q_out_ptr + t * stride_qo + h * HEAD_DIM
            tl.store(dst + offs, r1, mask=mask)
            tl.store(dst + half + offs, r2, mask=mask)
        elif slot >= 0:
            dst = k_cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
                + (h - NUM_HEADS) * stride_ch
            tl.store(dst + offs, r1, mask=mask)
            tl.store(dst + half + offs, r2, mask=mask)


def qkv_prep_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float, layer_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int, parts: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel behind qkv_prep_ref's contract (same arguments, same result). With `parts` [S, T, N] float32
    (contiguous) the row is qkv_partials.qkv_from_parts_ref(parts, bias, qkv.dtype) and qkv's contents are not
    read (only its shape and dtype)."""
    check_tensor(qkv, "qkv", (torch.float32, torch.bfloat16, torch.float16), 2, None)
    if parts is not None:
        check_tensor(parts, "parts", torch.float32, 3, qkv.device)
        if parts.shape[1:] != qkv.shape or not parts.is_contiguous() or parts.shape[0] < 1:
            raise ValueError(f"parts {tuple(parts.shape)} must be contiguous [S >= 1, {qkv.shape[0]}, {qkv.shape[1]}]")
    if bias is not None:
        if parts is None:
            raise ValueError("a bias goes with parts (an unsplit qkv row already holds it)")
        check_tensor(bias, "bias", qkv.dtype, 1, qkv.device)
        if bias.shape[0] != qkv.shape[1]:
            raise ValueError(f"bias has {bias.shape[0]} entries, the qkv row {qkv.shape[1]}")
    check_tensor(layer_cache, "layer_cache", qkv.dtype, 5, qkv.device)
    t = qkv.shape[0]
    check_projection_shapes(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    check_projection_layout(qkv, cos, sin, q_norm, k_norm)
    _, _, block_size, hkv, dim = layer_cache.shape
    if hkv != num_kv_heads or dim != head_dim:
        raise ValueError(f"layer_cache holds {hkv} KV heads of dim {dim}, expected {num_kv_heads} of {head_dim}")
    q_out = torch.empty(t, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)  # [T, Hq D]
    if t == 0:
        return q_out
    k_cache, v_cache = layer_cache[0], layer_cache[1]
    has_norm = q_norm is not None
    pdl = use_pdl(qkv.device)
    _qkv_prep_kernel[(t, num_heads + 2 * num_kv_heads)](
        qkv, q_out, q_norm if has_norm else qkv, k_norm if has_norm else qkv, cos, sin, slot_mapping,
        k_cache, v_cache, qkv.stride(0), q_out.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        parts if parts is not None else qkv, bias if bias is not None else qkv,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_PAD=max(16, triton.next_power_of_2(head_dim // 2)), BLOCK_SIZE=block_size, HAS_NORM=has_norm,
        PDL=pdl_mode(pdl, "qkv_prep", t), PARTS=parts is not None, SPLITS=parts.shape[0] if parts is not None else 1,
        HAS_BIAS=bias is not None, num_warps=1 if head_dim <= 128 else 2, launch_pdl=pdl,
    )
    return q_out


def paged_attention_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                        k_norm: torch.Tensor | None, eps: float, out: torch.Tensor, layer_idx: int, num_heads: int,
                        num_kv_heads: int, head_dim: int, scale: float, sliding_window: int,
                        parts: torch.Tensor | None = None, bias: torch.Tensor | None = None, k: int = 0) -> None:
    """graphrunner::paged_attention from the fused projection: qkv [T, (Hq + 2 Hkv) D], cos/sin [T, 1, D/2],
    optional per-head q/k RMSNorm weights [D] -> out [T, Hq*D]. The prologue kernel norms, ropes and writes k/v
    into the context's cache; like paged_attention, this is an opaque op where torch.compile's piecewise graphs
    split (graphrunner/opaque.py). With `parts` (qkv_partials.qkv_projection's buffer), `bias` and the
    projection's input width `k`: where qkv_partials.splits_at says the projection left partials, the row is
    their sum plus the bias, and qkv is not read."""
    args = (qkv, cos, sin, q_norm, k_norm, eps, out, layer_idx, num_heads, num_kv_heads, head_dim, scale,
            sliding_window, parts, bias, k)
    if torch.compiler.is_compiling():
        torch.ops.graphrunner.paged_attention_qkv(*args)
    else:
        _paged_attention_qkv(*args)


def _paged_attention_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, eps: float, out: torch.Tensor, layer_idx: int, num_heads: int,
                         num_kv_heads: int, head_dim: int, scale: float, sliding_window: int,
                         parts: torch.Tensor | None = None, bias: torch.Tensor | None = None, k: int = 0) -> None:
    ctx = get_forward_context()
    kernel = ctx.backend == "triton" and (not INTERPRETED or KERNEL_UNDER_INTERPRETER)
    t, n = qkv.shape
    splits = qkv_partials.splits_at(t, n, k, qkv.device) if parts is not None else 0
    split_parts = qkv_partials.parts_view(parts, splits, t, n) if parts is not None and splits else None  # [S, T, N]
    if split_parts is not None and (not kernel or decode_prep.DECODE_PREP):  # (routes() keeps the fold off it)
        qkv, split_parts = qkv_partials.qkv_from_parts_ref(split_parts, bias, qkv.dtype), None
    if split_parts is None and kernel and decode_prep.DECODE_PREP and ctx.meta.max_query_len <= 1:
        prep = DecodePrep(qkv, cos, sin, q_norm, k_norm, eps, ctx.meta.slot_mapping)  # the prologue inside attention
        attend_prepped(ctx, prep, out, layer_idx, num_heads, num_kv_heads, head_dim, scale, sliding_window)
        return
    layer_cache, slots = ctx.kv_cache[layer_idx], ctx.meta.slot_mapping
    if split_parts is not None:
        q = qkv_prep_triton(qkv, cos, sin, q_norm, k_norm, eps, layer_cache, slots, num_heads, num_kv_heads, head_dim,
                            split_parts, bias)  # [T, Hq*D]
    else:
        prep = qkv_prep_triton if kernel else qkv_prep_ref
        q = prep(qkv, cos, sin, q_norm, k_norm, eps, layer_cache, slots, num_heads, num_kv_heads, head_dim)
    attend(ctx, q.view(t, num_heads, head_dim), out, layer_idx, num_heads, num_kv_heads, head_dim, scale,
           sliding_window)


@opaque_op("paged_attention_qkv", _paged_attention_qkv, mutates_args=("out",)).register_fake
def _(*args: object) -> None:
    return None
