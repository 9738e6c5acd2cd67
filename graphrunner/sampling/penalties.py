"""Repetition / presence / frequency penalties (vLLM = HF semantics) applied in place to [B, V] float32 logits.

Triton: one kernel counts each row's history into a zeroed [B, V] int32 scratch (output tokens add 1, prompt tokens
set bit 30), a second applies the formula per (row, vocab block). The PyTorch reference uses scatters. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check

_BLOCK_L = 512  # history positions per iteration of one counting program
_MAX_CHUNKS = 32  # counting programs per row at most (each strides over the history)
_BLOCK_V = 1024  # vocab entries per apply program
_SEEN_BIT = 1 << 30  # set in counts[b, v] when v occurs in the prompt; the low 30 bits count output occurrences
_COUNT_MASK = _SEEN_BIT - 1




def _check_args(
    logits: Tensor, idx_mapping: Tensor, token_ids: Tensor, prompt_len: Tensor, num_tokens: Tensor,
    repetition: Tensor, presence: Tensor, frequency: Tensor,
) -> None:
    dev = logits.device
    _check(logits, "logits", torch.float32, 2, dev)
    _check(idx_mapping, "idx_mapping", torch.int32, 1, dev)
    _check(token_ids, "token_ids", torch.int32, 2, dev)
    if idx_mapping.shape[0] != logits.shape[0]:
        raise ValueError(f"idx_mapping has {idx_mapping.shape[0]} entries, logits has {logits.shape[0]} rows")
    if token_ids.stride(1) != 1 and token_ids.shape[1] > 1:
        raise ValueError("token_ids must have unit stride along its last dimension")
    num_rows = token_ids.shape[0]
    for t, name, dtype in ((prompt_len, "prompt_len", torch.int32), (num_tokens, "num_tokens", torch.int32),
                           (repetition, "repetition", torch.float32), (presence, "presence", torch.float32),
                           (frequency, "frequency", torch.float32)):
        _check(t, name, dtype, 1, dev)
        if t.shape[0] != num_rows:
            raise ValueError(f"{name} has {t.shape[0]} entries, token_ids has {num_rows} rows")


# ---------------------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------------------


def apply_penalties_ref(
    logits: Tensor,  # [B, V] float32, modified in place
    idx_mapping: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32
    prompt_len: Tensor,  # [R] int32
    num_tokens: Tensor,  # [R] int32
    repetition: Tensor,  # [R] float32
    presence: Tensor,  # [R] float32
    frequency: Tensor,  # [R] float32
) -> None:
    """PyTorch reference: scatter the gathered [B, L] history into [B, V + 1] (column V absorbs invalid positions)."""
    _check_args(logits, idx_mapping, token_ids, prompt_len, num_tokens, repetition, presence, frequency)
    num_reqs, vocab_size = logits.shape
    max_len = token_ids.shape[1]
    if num_reqs == 0 or vocab_size == 0:
        return
    dev = logits.device
    rows = idx_mapping.long()  # [B] int64
    hist = token_ids[rows].long()  # [B, L] int64
    pos = torch.arange(max_len, device=dev)  # [L] int64
    valid = (pos[None, :] < num_tokens[rows, None]) & (hist >= 0) & (hist < vocab_size)  # [B, L] bool
    is_out = valid & (pos[None, :] >= prompt_len[rows, None])  # [B, L] bool
    ones = torch.ones(num_reqs, max_len, dtype=torch.int32, device=dev)  # [B, L] int32
    counts = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.int32, device=dev)  # [B, V + 1] int32
    counts.scatter_add_(1, torch.where(is_out, hist, vocab_size), ones)
    seen = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=dev)  # [B, V + 1] bool
    seen.scatter_(1, torch.where(valid, hist, vocab_size), True)
    counts, seen = counts[:, :vocab_size], seen[:, :vocab_size]  # [B, V]

    rep = repetition[rows, None]  # [B, 1] float32
    pres = presence[rows, None]  # [B, 1] float32
    freq = frequency[rows, None]  # [B, 1] float32
    x = logits  # [B, V] float32
    x_rep = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    new = x_rep - (freq * counts.to(torch.float32) + pres * (counts > 0).to(torch.float32))
    neutral = (rep == 1.0) & (pres == 0.0) & (freq == 0.0)  # [B, 1] bool
    logits.copy_(torch.where(neutral, x, new))


# ---------------------------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _penalty_counts_kernel(
    idx_mapping_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    token_ids_stride,
    prompt_len_ptr,  # [R] int32
    num_tokens_ptr,  # [R] int32
    rep_ptr,  # [R] float32
    pres_ptr,  # [R] float32
    freq_ptr,  # [R] float32
    counts_ptr,  # [B, V] int32, zeroed
    vocab_size,
    max_len,
    BLOCK_L: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    rep = tl.load(rep_ptr + row)
    active = (rep != 1.0) | (tl.load(pres_ptr + row) != 0.0) | (tl.load(freq_ptr + row) != 0.0)
    pl = tl.load(prompt_len_ptr + row)
    nt = tl.minimum(tl.load(num_tokens_ptr + row), max_len)
    nt = tl.where(active, nt, 0)  # neutral rows count nothing
    lo = tl.where(rep != 1.0, 0, tl.maximum(pl, 0))  # the prompt only matters to the repetition penalty
    src = token_ids_ptr + row * token_ids_stride
    dst = counts_ptr + pid.to(tl.int64) * vocab_size
    offs = tl.arange(0, BLOCK_L)
    for start in range(lo + chunk * BLOCK_L, nt, NUM_CHUNKS * BLOCK_L):
        p = start + offs
        m = p < nt
        tok = tl.load(src + p, mask=m, other=0)
        m = m & (tok >= 0) & (tok < vocab_size)  # ids outside the logits' vocab are ignored
        out = p >= pl
        tl.atomic_add(dst + tok, 1, mask=m & out, sem="relaxed")
        tl.atomic_or(dst + tok, 1073741824, mask=m & ~out, sem="relaxed")  # _SEEN_BIT


@triton.jit
def _apply_penalties_kernel(
    logits_ptr,  # [B, V] float32
    stride_b,
    stride_v,
    idx_mapping_ptr,  # [B] int32
    rep_ptr,  # [R] float32
    pres_ptr,  # [R] float32
    freq_ptr,  # [R] float32
    counts_ptr,  # [B, V] int32
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    rep = tl.load(rep_ptr + row)
    pres = tl.load(pres_ptr + row)
    freq = tl.load(freq_ptr + row)
    active = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
    m = offs < tl.where(active, vocab_size, 0)  # neutral rows are neither read nor written: bit-identical
    c = tl.load(counts_ptr + pid.to(tl.int64) * vocab_size + offs, mask=m, other=0)
    ptrs = logits_ptr + pid.to(tl.int64) * stride_b + offs.to(tl.int64) * stride_v
    x = tl.load(ptrs, mask=m, other=0.0)
    cnt = c & 1073741823  # _COUNT_MASK
    rep_v = tl.broadcast_to(rep, (BLOCK_V,))
    x = tl.where(c != 0, tl.where(x > 0, tl.div_rn(x, rep_v), x * rep), x)  # IEEE division, as torch
    x = x - (freq * cnt.to(tl.float32) + pres * (cnt > 0).to(tl.float32))
    tl.store(ptrs, x, mask=m)


def apply_penalties_triton(
    logits: Tensor, idx_mapping: Tensor, token_ids: Tensor, prompt_len: Tensor, num_tokens: Tensor,
    repetition: Tensor, presence: Tensor, frequency: Tensor,
) -> None:
    """Triton version: a memset of the [B, V] int32 scratch, then the counting and the apply kernels."""
    _check_args(logits, idx_mapping, token_ids, prompt_len, num_tokens, repetition, presence, frequency)
    num_reqs, vocab_size = logits.shape
    max_len = token_ids.shape[1]
    if num_reqs == 0 or vocab_size == 0:
        return
    idx_mapping = idx_mapping.contiguous()
    repetition, presence, frequency = repetition.contiguous(), presence.contiguous(), frequency.contiguous()
    counts = torch.zeros(num_reqs, vocab_size, dtype=torch.int32, device=logits.device)  # [B, V] int32
    if max_len > 0:
        num_chunks = min(triton.cdiv(max_len, _BLOCK_L), _MAX_CHUNKS)
        _penalty_counts_kernel[(num_reqs, num_chunks)](
            idx_mapping, token_ids, token_ids.stride(0), prompt_len.contiguous(), num_tokens.contiguous(),
            repetition, presence, frequency, counts, vocab_size, max_len, BLOCK_L=_BLOCK_L, NUM_CHUNKS=num_chunks,
        )
    block_v = min(_BLOCK_V, triton.next_power_of_2(vocab_size))
    _apply_penalties_kernel[(num_reqs, triton.cdiv(vocab_size, block_v))](
        logits, logits.stride(0), logits.stride(1), idx_mapping, repetition, presence, frequency, counts,
        vocab_size, BLOCK_V=block_v, enable_fp_fusion=False,  # no FMA: bit-equal to torch's mul-then-add
    )


def apply_penalties(
    logits: Tensor,  # [B, V] float32, modified in place
    idx_mapping: Tensor,  # [B] int32: state-table row of batch row b
    token_ids: Tensor,  # [R, L] int32 persistent history (prompt then outputs)
    prompt_len: Tensor,  # [R] int32
    num_tokens: Tensor,  # [R] int32 valid history length (prompt + outputs so far)
    repetition: Tensor,  # [R] float32, 1.0 = off
    presence: Tensor,  # [R] float32, 0.0 = off
    frequency: Tensor,  # [R] float32, 0.0 = off
    use_triton: bool,
) -> None:
    """For batch row b (r = idx_mapping[b]) and every vocab id v: if v occurs in token_ids[r, :num_tokens[r]],
    logit = logit / rep if logit > 0 else logit * rep; then logit -= freq * count[v] + pres * (count[v] > 0), count
    over the outputs token_ids[r, prompt_len[r]:num_tokens[r]]. Rows with all three parameters neutral are untouched;
    history ids outside [0, V) are ignored. Unchecked (checking would sync): idx_mapping values lie in [0, R).
    """
    fn = apply_penalties_triton if use_triton else apply_penalties_ref
    fn(logits, idx_mapping, token_ids, prompt_len, num_tokens, repetition, presence, frequency)
