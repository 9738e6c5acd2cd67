"""Top-k / top-p / min-p logit filtering (vLLM order: min_p, then top_k, then top_p), in place, ties kept.

The Triton kernel runs one program per row and never sorts: each threshold is found by a bisection over the monotone
int32 image of the float32 bits, each step one counting (top-k) or exp-sum (top-p) pass over the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK_V = 4096  # vocab entries per loop iteration of one program (as in gumbel.py)
_MAX_VOCAB = 1 << 24  # top-k counts are accumulated in float32, exact below 2**24
# _key(-inf): the bits 0xFF800000 ^ 0x7FFFFFFF as int32; every finite value's key is larger.
_KEY_NEG_INF: tl.constexpr = tl.constexpr(-2139095041)

# ---------------------------------------------------------------------------------------------------------------
# Triton kernel.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _key(x):
    # float32 -> int32, strictly monotone on non-NaN values: x < y <=> key(x) < key(y); -0.0 maps like +0.0.
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _bisect(row_ptr, stride_v, vocab_size, lo, hi, m, target, USE_EXP: tl.constexpr, BLOCK_V: tl.constexpr):
    # Largest key T in [lo, hi) with W(T) = sum_{key(x) >= T} w(x) >= target (lo is the fallback when none is),
    # w = 1 (top-k count) or exp(x - m) (top-p mass). lo, hi: int64 scalars; hi - 1 is the key of a row value.
    # Each pass also snaps the interval to row values (smallest key >= mid, largest key < mid): W is constant between
    # consecutive values, so this keeps the answer and usually ends long before the 32 plain bisection steps.
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        mid32 = mid.to(tl.int32)
        acc = tl.full((), 0.0, tl.float32)
        above = (hi - 1).to(tl.int32)  # smallest key >= mid
        below = lo.to(tl.int32)  # largest key < mid (or lo)
        for v0 in range(0, vocab_size, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < vocab_size, other=float("-inf"))
            key = _key(x)  # [BLOCK_V] int32; padding and -inf are below mid (mid > lo >= _key(-inf) + 1)
            sel = key >= mid32
            if USE_EXP:
                w = tl.where(sel, tl.exp(x - m), 0.0)
            else:
                w = sel.to(tl.float32)
            acc += tl.sum(w, axis=0)
            above = tl.minimum(above, tl.min(tl.where(sel, key, 2147483647), axis=0))
            below = tl.maximum(below, tl.max(tl.where(sel, -2147483647, key), axis=0))
        ok = acc >= target
        lo = tl.where(ok, above.to(tl.int64), lo)
        hi = tl.where(ok, hi, below.to(tl.int64) + 1)
    return lo


@triton.jit
def _filters_kernel(
    logits_ptr,  # [B, V] float32, modified in place
    stride_b,
    stride_v,
    idx_mapping_ptr,  # [B] int32
    top_k_ptr,  # [R] int32
    top_p_ptr,  # [R] float32
    log_min_p_ptr,  # [R] float32, log(clamp(min_p, 0, 1)); -inf = off
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    k = tl.load(top_k_ptr + row)
    p = tl.load(top_p_ptr + row)
    log_min_p = tl.load(log_min_p_ptr + row)
    k_on = (k > 0) & (k < vocab_size)
    p_on = p < 1.0
    if k_on | p_on | (log_min_p > float("-inf")):  # an all-off row is never read nor written
        row_ptr = logits_ptr + pid.to(tl.int64) * stride_b
        m = tl.full((), float("-inf"), tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < vocab_size, other=float("-inf"))
            m = tl.maximum(m, tl.max(x, axis=0))
        top = _key(m).to(tl.int64) + 1  # no threshold can exceed the row max
        m_exp = tl.where(m > float("-inf"), m, 0.0)  # exp(x - m_exp) stays NaN-free on an all -inf row
        # min_p: keep x >= m + log(min_p); -inf entries never count (hence the + 1).
        lo = tl.maximum(_key(m + log_min_p), _KEY_NEG_INF + 1).to(tl.int64)
        # top_k: largest T with count(key >= T) >= k among the tokens kept so far (all of them when fewer than k).
        lo = _bisect(row_ptr, stride_v, vocab_size, lo, tl.where(k_on, top, lo + 1), m_exp, k.to(tl.float32),
                     False, BLOCK_V)
        if p_on:
            lo32 = lo.to(tl.int32)
            z = tl.full((), 0.0, tl.float32)  # sum of exp(x - m) over the tokens kept so far
            for v0 in range(0, vocab_size, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < vocab_size, other=float("-inf"))
                z += tl.sum(tl.where(_key(x) >= lo32, tl.exp(x - m_exp), 0.0), axis=0)
            # top_p: largest T whose top set holds >= top_p of the renormalised mass.
            lo = _bisect(row_ptr, stride_v, vocab_size, lo, top, m_exp, p * z, True, BLOCK_V)
        thr = lo.to(tl.int32)
        for v0 in range(0, vocab_size, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            ptrs = row_ptr + offs.to(tl.int64) * stride_v
            in_row = offs < vocab_size
            x = tl.load(ptrs, mask=in_row, other=float("-inf"))
            drop = in_row & (_key(x) < thr)
            tl.store(ptrs, tl.full((BLOCK_V,), float("-inf"), tl.float32), mask=drop)


# ---------------------------------------------------------------------------------------------------------------
# Launchers, reference and dispatcher.
# ---------------------------------------------------------------------------------------------------------------


def _check(t: Tensor, name: str, dtype: torch.dtype, device: torch.device) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != (2 if name == "logits" else 1):
        raise ValueError(f"{name} must be {2 if name == 'logits' else 1}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_filters(logits: Tensor, idx_mapping: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> None:
    dev = logits.device
    _check(logits, "logits", torch.float32, dev)
    _check(idx_mapping, "idx_mapping", torch.int32, dev)
    _check(top_k, "top_k", torch.int32, dev)
    _check(top_p, "top_p", torch.float32, dev)
    _check(min_p, "min_p", torch.float32, dev)
    if idx_mapping.shape[0] != logits.shape[0]:
        raise ValueError(f"idx_mapping has {idx_mapping.shape[0]} entries, logits has {logits.shape[0]} rows")
    if not 1 <= logits.shape[1] < _MAX_VOCAB:
        raise ValueError(f"logits vocab dimension must be in [1, 2**24), got {logits.shape[1]}")
    if not top_k.shape[0] == top_p.shape[0] == min_p.shape[0]:
        raise ValueError(
            f"per-row tables differ in length: top_k {top_k.shape[0]}, top_p {top_p.shape[0]}, min_p {min_p.shape[0]}"
        )


def _log_min_p(min_p: Tensor) -> Tensor:  # [R] float32
    """log(min_p) clamped to [-inf, 0]; shared by both paths so that their min_p thresholds agree to the bit."""
    return torch.log(min_p.clamp(0.0, 1.0))


def apply_filters_ref(
    logits: Tensor,  # [B, V] float32, modified in place
    idx_mapping: Tensor,  # [B] int32
    top_k: Tensor,  # [R] int32; <= 0 or >= V = off
    top_p: Tensor,  # [R] float32; >= 1 = off (<= 0 keeps the argmax and its ties)
    min_p: Tensor,  # [R] float32; <= 0 = off (clamped to 1 above)
) -> None:
    """PyTorch reference of apply_filters: one descending sort per row, thresholds read off the sorted values."""
    _check_filters(logits, idx_mapping, top_k, top_p, min_p)
    num_reqs, vocab_size = logits.shape
    if num_reqs == 0:
        return
    neg_inf = float("-inf")
    rows = idx_mapping.long()  # [B] int64
    k = top_k[rows].long()  # [B] int64
    p = top_p[rows]  # [B] float32
    log_mp = _log_min_p(min_p)[rows]  # [B] float32
    k_on = (k > 0) & (k < vocab_size)  # [B] bool
    p_on = p < 1.0  # [B] bool
    any_on = k_on | p_on | (log_mp > neg_inf)  # [B] bool
    s = torch.sort(logits, dim=-1, descending=True).values  # [B, V] float32
    m = s[:, :1]  # [B, 1] row max
    # Each stage masks the sorted row to the tokens it keeps (a threshold keeps the order), then raises thr.
    thr = m + log_mp[:, None]  # [B, 1] min_p threshold
    s = torch.where(s >= thr, s, neg_inf)
    kth = s.gather(1, (k.clamp(1, vocab_size) - 1)[:, None])  # [B, 1]; -inf when fewer than k tokens are left
    thr = torch.where(k_on[:, None], torch.maximum(thr, kth), thr)
    s = torch.where(s >= thr, s, neg_inf)
    e = torch.exp(s - torch.where(m > neg_inf, m, 0.0))  # [B, V] unnormalised probabilities, 0 for dropped tokens
    c = e.cumsum(dim=-1)  # [B, V]
    # First sorted position whose cumulative mass reaches top_p * total; its value is the threshold (ties kept).
    first = (c < p[:, None] * c[:, -1:]).sum(dim=-1, keepdim=True).clamp(max=vocab_size - 1)  # [B, 1] int64
    thr = torch.where(p_on[:, None], torch.maximum(thr, s.gather(1, first)), thr)
    logits.masked_fill_((logits < thr) & any_on[:, None], neg_inf)


def apply_filters_triton(
    logits: Tensor,  # [B, V] float32 (any strides), modified in place
    idx_mapping: Tensor,  # [B] int32
    top_k: Tensor,  # [R] int32
    top_p: Tensor,  # [R] float32
    min_p: Tensor,  # [R] float32
) -> None:
    """Triton version of apply_filters: one program per row, thresholds by bisection, no sort."""
    _check_filters(logits, idx_mapping, top_k, top_p, min_p)
    num_reqs, vocab_size = logits.shape
    if num_reqs == 0:
        return
    block_v = min(_BLOCK_V, triton.next_power_of_2(vocab_size))
    num_warps = max(4, min(16, block_v // 256))
    _filters_kernel[(num_reqs,)](
        logits, logits.stride(0), logits.stride(1), idx_mapping.contiguous(), top_k.contiguous(),
        top_p.contiguous(), _log_min_p(min_p), vocab_size, BLOCK_V=block_v, num_warps=num_warps,
    )


def apply_filters(
    logits: Tensor,  # [B, V] float32, already divided by temperature; modified in place
    idx_mapping: Tensor,  # [B] int32 state-table row of batch row b
    top_k: Tensor,  # [R] int32 per row; 0 (or >= V) = off
    top_p: Tensor,  # [R] float32 per row; 1.0 = off
    min_p: Tensor,  # [R] float32 per row; 0.0 = off
    use_triton: bool,
) -> None:
    """Set filtered-out logits to -inf: min_p, then top_k, then top_p over the survivors; ties at a threshold stay."""
    fn = apply_filters_triton if use_triton else apply_filters_ref
    fn(logits, idx_mapping, top_k, top_p, min_p)
