"""Repetition / presence / frequency penalties (vLLM = HF semantics) applied in place to [B, V] float32 logits, from
the persistent per-row statistics of graphrunner.penalty_counts (output counts, prompt bitmask): nothing is recounted.

The apply kernel (Triton) sits next to its PyTorch reference; `apply_penalties_history_ref` recounts a row's whole
history instead, and is kept only as the reference the persistent statistics are tested against. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check
from graphrunner.penalty_counts import PenaltyCounts, mask_words

_BLOCK_V = 2048  # vocab entries per apply program (a multiple of 32: one program reads whole mask words)



def _check_history_args(
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


def apply_penalties_history_ref(
    logits: Tensor,  # [B, V] float32, modified in place
    idx_mapping: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32
    prompt_len: Tensor,  # [R] int32
    num_tokens: Tensor,  # [R] int32
    repetition: Tensor,  # [R] float32
    presence: Tensor,  # [R] float32
    frequency: Tensor,  # [R] float32
) -> None:
    """The recounting reference: scatter the gathered [B, L] history into [B, V + 1] (column V absorbs invalid
    positions), then the formula. Same result as apply_penalties over statistics filled and updated from that
    history; see apply_penalties for the semantics."""
    _check_history_args(logits, idx_mapping, token_ids, prompt_len, num_tokens, repetition, presence, frequency)
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
# From the persistent statistics: PyTorch reference and Triton
# ---------------------------------------------------------------------------------------------------------------


def _check_args(logits: Tensor, idx_mapping: Tensor, counts: Tensor, prompt_mask: Tensor, repetition: Tensor,
                presence: Tensor, frequency: Tensor) -> None:
    dev = logits.device
    _check(logits, "logits", torch.float32, 2, dev)
    _check(idx_mapping, "idx_mapping", torch.int32, 1, dev)
    _check(counts, "output_counts", torch.int32, 2, dev)
    _check(prompt_mask, "prompt_mask", torch.int32, 2, dev)
    if idx_mapping.shape[0] != logits.shape[0]:
        raise ValueError(f"idx_mapping has {idx_mapping.shape[0]} entries, logits has {logits.shape[0]} rows")
    if counts.shape[1] != logits.shape[1]:
        raise ValueError(f"output_counts covers a vocabulary of {counts.shape[1]}, logits have {logits.shape[1]} "
                         "columns")
    if prompt_mask.shape != (counts.shape[0], mask_words(counts.shape[1])):
        raise ValueError(f"prompt_mask must be [{counts.shape[0]}, {mask_words(counts.shape[1])}] int32, got "
                         f"{list(prompt_mask.shape)}")
    if not (counts.is_contiguous() and prompt_mask.is_contiguous()):
        raise ValueError("output_counts and prompt_mask must be contiguous")
    for t, name in ((repetition, "repetition"), (presence, "presence"), (frequency, "frequency")):
        _check(t, name, torch.float32, 1, dev)
        if t.shape[0] != counts.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} entries, output_counts has {counts.shape[0]} rows")


def _formula(x: Tensor, seen: Tensor, counts: Tensor, rep: Tensor, pres: Tensor, freq: Tensor) -> Tensor:
    """The penalties on x [B, V] float32: seen [B, V] bool (prompt or output), counts [B, V] int32 (outputs)."""
    x_rep = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    new = x_rep - (freq * counts.to(torch.float32) + pres * (counts > 0).to(torch.float32))
    neutral = (rep == 1.0) & (pres == 0.0) & (freq == 0.0)  # [B, 1] bool
    return torch.where(neutral, x, new)


def apply_penalties_ref(
    logits: Tensor,  # [B, V] float32, modified in place
    idx_mapping: Tensor,  # [B] int32
    counts: Tensor,  # [R, V] int32 output counts
    prompt_mask: Tensor,  # [R, ceil(V / 32)] int32 prompt bitmask
    repetition: Tensor,  # [R] float32
    presence: Tensor,  # [R] float32
    frequency: Tensor,  # [R] float32
) -> None:
    """PyTorch reference: gather the rows' statistics, unpack the bitmask, the formula."""
    _check_args(logits, idx_mapping, counts, prompt_mask, repetition, presence, frequency)
    num_reqs, vocab_size = logits.shape
    if num_reqs == 0 or vocab_size == 0:
        return
    rows = idx_mapping.long()  # [B] int64
    c = counts[rows]  # [B, V] int32
    bits = (prompt_mask[rows, :, None] >> torch.arange(32, device=logits.device, dtype=torch.int32)) & 1  # [B, W, 32]
    in_prompt = bits.reshape(num_reqs, -1)[:, :vocab_size].bool()  # [B, V] bool
    logits.copy_(_formula(logits, in_prompt | (c > 0), c, repetition[rows, None], presence[rows, None],
                          frequency[rows, None]))


@triton.jit
def _apply_penalties_kernel(
    logits_ptr,  # [B, V] float32
    stride_b,
    stride_v,
    idx_mapping_ptr,  # [B] int32
    rep_ptr,  # [R] float32
    pres_ptr,  # [R] float32
    freq_ptr,  # [R] float32
    counts_ptr,  # [R, V] int32
    mask_ptr,  # [R, W] int32
    vocab_size,
    num_words,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    rep = tl.load(rep_ptr + row)
    pres = tl.load(pres_ptr + row)
    freq = tl.load(freq_ptr + row)
    if (rep != 1.0) | (pres != 0.0) | (freq != 0.0):  # neutral rows are neither read nor written: bit-identical
        offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        m = offs < vocab_size
        c = tl.load(counts_ptr + row * vocab_size + offs, mask=m, other=0)
        words = tl.program_id(1) * (BLOCK_V // 32) + tl.arange(0, BLOCK_V // 32)
        packed = tl.load(mask_ptr + row * num_words + words, mask=words < num_words, other=0)
        in_prompt = tl.reshape((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1, (BLOCK_V,))
        ptrs = logits_ptr + pid.to(tl.int64) * stride_b + offs.to(tl.int64) * stride_v
        x = tl.load(ptrs, mask=m, other=0.0)
        rep_v = tl.broadcast_to(rep, (BLOCK_V,))
        x = tl.where((in_prompt != 0) | (c > 0), tl.where(x > 0, tl.div_rn(x, rep_v), x * rep), x)  # IEEE division
        x = x - (freq * c.to(tl.float32) + pres * (c > 0).to(tl.float32))
        tl.store(ptrs, x, mask=m)


def apply_penalties_triton(logits: Tensor, idx_mapping: Tensor, counts: Tensor, prompt_mask: Tensor,
                           repetition: Tensor, presence: Tensor, frequency: Tensor) -> None:
    """Triton version: one program per (batch row, vocab block); neutral rows return at once."""
    _check_args(logits, idx_mapping, counts, prompt_mask, repetition, presence, frequency)
    num_reqs, vocab_size = logits.shape
    if num_reqs == 0 or vocab_size == 0:
        return
    block_v = min(_BLOCK_V, max(32, triton.next_power_of_2(vocab_size)))
    _apply_penalties_kernel[(num_reqs, triton.cdiv(vocab_size, block_v))](
        logits, logits.stride(0), logits.stride(1), idx_mapping.contiguous(), repetition.contiguous(),
        presence.contiguous(), frequency.contiguous(), counts, prompt_mask, vocab_size, prompt_mask.shape[1],
        BLOCK_V=block_v, enable_fp_fusion=False,  # no FMA: bit-equal to torch's mul-then-add
    )


def apply_penalties(
    logits: Tensor,  # [B, V] float32, modified in place
    idx_mapping: Tensor,  # [B] int32: state-table row of batch row b
    pen: PenaltyCounts,  # the rows' output counts, prompt bitmask and parameters
    use_triton: bool,
) -> None:
    """For batch row b (r = idx_mapping[b]) and every vocab id v: if v occurs in r's prompt or outputs,
    logit = logit / rep if logit > 0 else logit * rep; then logit -= freq * count[v] + pres * (count[v] > 0), count
    over r's outputs. Rows with all three parameters neutral are untouched (so their statistics are never read).
    Unchecked (checking would sync): idx_mapping values lie in [0, R).
    """
    fn = apply_penalties_triton if use_triton else apply_penalties_ref
    fn(logits, idx_mapping, pen.output_counts, pen.prompt_mask, pen.repetition, pen.presence, pen.frequency)
