"""The flash-decoding merge of split KV ranges: each split program of the attention kernel (triton_attention.py)
leaves its unnormalised output and its (max, sum) per row, and these combine them. `_merge_splits_kernel` is its own
launch, one program per (token, head); `_merge_rows` is the same arithmetic, in the same order, for the folded merge
(GRAPHRUNNER_ATTN_FOLD_MERGE) inside the attention kernel's last split program. The split loops are unrolled
(static_range), so every split's loads issue together instead of one L2 round trip per split; the adds keep their
order, so the bits do not change. A split with no key stores only its (m, l) = (-inf, 0); its acc is never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphrunner.kernel_checks import step_sizes
from graphrunner.pdl import pdl_enter


@triton.jit
def _merge_rows(part_acc_ptr, part_ml_ptr, out_ptr, tok, head, row_ok, d, d_ok, stride_ot, stride_oh, num_tokens,
                num_q_heads, BLOCK_M: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The folded merge of one tile's rows [BLOCK_M]: _merge_splits_kernel's arithmetic, in its order, per row (so
    the bits match it); partials read through L2 (.cg: other SMs wrote them)."""
    m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (s * num_tokens + tok) * num_q_heads + head
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + row.to(tl.int64) * 2, mask=row_ok, other=0.0,
                                          cache_modifier=".cg"))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (s * num_tokens + tok) * num_q_heads + head
        m_s = tl.load(part_ml_ptr + row.to(tl.int64) * 2, mask=row_ok, other=0.0, cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + row.to(tl.int64) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_safe))  # an empty split adds nothing
        acc += tl.load(part_acc_ptr + row[:, None].to(tl.int64) * D_PAD + d[None, :],
                       mask=(row_ok & (m_s != float("-inf")))[:, None], other=0.0, cache_modifier=".cg") * w[:, None]
        den += l_s * w
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=step_sizes("num_tokens"))
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, num_tokens, num_q_heads,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_enter(PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    m_max = tl.full([1], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (s * num_tokens + tok) * num_q_heads + head
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + row.to(tl.int64) * 2 + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    acc = tl.zeros([D_PAD], tl.float32)
    den = tl.zeros([1], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (s * num_tokens + tok) * num_q_heads + head
        m_s = tl.load(part_ml_ptr + row.to(tl.int64) * 2 + tl.zeros([1], tl.int32))
        l_s = tl.load(part_ml_ptr + row.to(tl.int64) * 2 + 1 + tl.zeros([1], tl.int32))
        w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_safe))  # an empty split adds nothing
        # an empty split stored no acc (the memory may hold NaN): read it only where m > -inf
        acc += tl.load(part_acc_ptr + row.to(tl.int64) * D_PAD + d, mask=m_s != float("-inf"), other=0.0) * w
        den += l_s * w
    out = acc / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
