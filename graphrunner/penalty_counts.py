"""Persistent per-row penalty statistics (vLLM MRV2's output_bin_counts / prompt_bin_mask): how often each vocab id
occurs in a row's outputs, and a bitmask of the ids in its prompt. Filled once when a row is (re)admitted, then kept
up to date by the post-update of every step, so the penalty stage never recounts a history.

Holds the tensors, the admission fill (Triton kernel + PyTorch reference) and the verify-step hook (PyTorch only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check

_BLOCK_L = 512  # history positions per iteration of one fill program
_MAX_CHUNKS = 32  # fill programs per row at most (each strides over the history)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's prompt bitmask."""
    return (vocab_size + 31) // 32


@dataclass
class PenaltyCounts:
    """The statistics of every state-table row, and views of the penalty parameters they serve."""

    output_counts: Tensor  # [R, V] int32: occurrences of each id among the row's output tokens
    prompt_mask: Tensor    # [R, ceil(V / 32)] int32: bit v % 32 of word v // 32 set when v occurs in the prompt
    repetition: Tensor     # [R] float32, 1.0 = off (a view of the state table's parameters)
    presence: Tensor       # [R] float32, 0.0 = off
    frequency: Tensor      # [R] float32, 0.0 = off

    @property
    def vocab_size(self) -> int:
        return self.output_counts.shape[1]

    @staticmethod
    def allocate(num_rows: int, vocab_size: int, repetition: Tensor, presence: Tensor,
                 frequency: Tensor) -> PenaltyCounts:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        dev = repetition.device
        return PenaltyCounts(torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=dev),
                             torch.zeros(num_rows, mask_words(vocab_size), dtype=torch.int32, device=dev),
                             repetition, presence, frequency)

    @staticmethod
    def nbytes(num_rows: int, vocab_size: int) -> int:
        return num_rows * (vocab_size + mask_words(vocab_size)) * 4


def count_kernel_args(pen: PenaltyCounts | None, placeholder: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """(output_counts, repetition, presence, frequency, vocab_size) for a post-update kernel that counts appended
    tokens (state_kernels.post_update, spec_decode.update.post_update_spec). Without statistics, `placeholder`
    stands in for the tensors, which the kernel then never reads (HAS_COUNTS False)."""
    if pen is None:
        return placeholder, placeholder, placeholder, placeholder, 0
    return pen.output_counts, pen.repetition, pen.presence, pen.frequency, pen.vocab_size


def _check_fill(rows: Tensor, token_ids: Tensor, prompt_len: Tensor, num_tokens: Tensor, counts: Tensor,
                prompt_mask: Tensor) -> None:
    dev = token_ids.device
    _check(rows, "rows", torch.int32, 1, dev)
    _check(token_ids, "token_ids", torch.int32, 2, dev)
    _check(prompt_len, "prompt_len", torch.int32, 1, dev)
    _check(num_tokens, "num_tokens", torch.int32, 1, dev)
    _check(counts, "output_counts", torch.int32, 2, dev)
    _check(prompt_mask, "prompt_mask", torch.int32, 2, dev)
    r = token_ids.shape[0]
    for t, name in ((prompt_len, "prompt_len"), (num_tokens, "num_tokens"), (counts, "output_counts"),
                    (prompt_mask, "prompt_mask")):
        if t.shape[0] != r:
            raise ValueError(f"{name} has {t.shape[0]} rows, token_ids has {r}")
    if prompt_mask.shape[1] != mask_words(counts.shape[1]):
        raise ValueError(f"prompt_mask has {prompt_mask.shape[1]} words a row, a vocabulary of {counts.shape[1]} "
                         f"needs {mask_words(counts.shape[1])}")
    if token_ids.stride(1) != 1 and token_ids.shape[1] > 1:
        raise ValueError("token_ids must have unit stride along its last dimension")
    if not (counts.is_contiguous() and prompt_mask.is_contiguous()):
        raise ValueError("output_counts and prompt_mask must be contiguous (they are written in place)")


# ---------------------------------------------------------------------------------------------------------------
# fill: rebuild the statistics of freshly admitted rows from their history
# ---------------------------------------------------------------------------------------------------------------


def fill_counts_ref(
    rows: Tensor,  # [N] int32 distinct rows to rebuild
    token_ids: Tensor,  # [R, L] int32 history (prompt, then outputs)
    prompt_len: Tensor,  # [R] int32
    num_tokens: Tensor,  # [R] int32
    counts: Tensor,  # [R, V] int32, rows of `rows` rewritten
    prompt_mask: Tensor,  # [R, W] int32, rows of `rows` rewritten
) -> None:
    """PyTorch reference: scatter the gathered [N, L] history into [N, V + 1] (column V absorbs invalid positions)."""
    _check_fill(rows, token_ids, prompt_len, num_tokens, counts, prompt_mask)
    n, vocab = rows.shape[0], counts.shape[1]
    if n == 0:
        return
    dev = token_ids.device
    r = rows.long()  # [N] int64
    max_len = token_ids.shape[1]
    hist = token_ids[r].long()  # [N, L] int64
    pos = torch.arange(max_len, device=dev)  # [L] int64
    valid = (pos[None, :] < num_tokens[r, None]) & (hist >= 0) & (hist < vocab)  # [N, L] bool
    is_out = valid & (pos[None, :] >= prompt_len[r, None])  # [N, L] bool
    is_prompt = valid & ~is_out
    out = torch.zeros(n, vocab + 1, dtype=torch.int32, device=dev)  # [N, V + 1] int32
    out.scatter_add_(1, torch.where(is_out, hist, vocab), torch.ones_like(hist, dtype=torch.int32))
    seen = torch.zeros(n, mask_words(vocab) * 32 + 1, dtype=torch.bool, device=dev)  # [N, 32 W + 1] bool
    seen.scatter_(1, torch.where(is_prompt, hist, seen.shape[1] - 1), True)
    bits = seen[:, :-1].view(n, -1, 32).to(torch.int64) << torch.arange(32, device=dev)  # [N, W, 32] int64
    words = bits.sum(-1)  # [N, W] int64, in [0, 2^32)
    counts[r] = out[:, :vocab]
    prompt_mask[r] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


@triton.jit
def _fill_counts_kernel(
    rows_ptr,  # [N] int32
    token_ids_ptr,  # [R, L] int32
    token_ids_stride,
    prompt_len_ptr,  # [R] int32
    num_tokens_ptr,  # [R] int32
    counts_ptr,  # [R, V] int32, the rows zeroed
    mask_ptr,  # [R, W] int32, the rows zeroed
    vocab_size,
    num_words,
    max_len,
    BLOCK_L: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    chunk = tl.program_id(1)
    pl = tl.load(prompt_len_ptr + row)
    nt = tl.minimum(tl.load(num_tokens_ptr + row), max_len)
    src = token_ids_ptr + row * token_ids_stride
    cnt = counts_ptr + row * vocab_size
    msk = mask_ptr + row * num_words
    offs = tl.arange(0, BLOCK_L)
    for start in range(chunk * BLOCK_L, nt, NUM_CHUNKS * BLOCK_L):
        p = start + offs
        m = p < nt
        tok = tl.load(src + p, mask=m, other=0)
        m = m & (tok >= 0) & (tok < vocab_size)  # ids outside the logits' vocab are ignored
        out = p >= pl
        tl.atomic_add(cnt + tok, 1, mask=m & out, sem="relaxed")
        bit = tl.full((BLOCK_L,), 1, tl.int32) << (tok % 32)
        tl.atomic_or(msk + tok // 32, bit, mask=m & ~out, sem="relaxed")


def fill_counts_triton(rows: Tensor, token_ids: Tensor, prompt_len: Tensor, num_tokens: Tensor, counts: Tensor,
                       prompt_mask: Tensor) -> None:
    """Triton version: zero the rows, then one program per (row, history chunk) with atomic adds / ors."""
    _check_fill(rows, token_ids, prompt_len, num_tokens, counts, prompt_mask)
    n, max_len = rows.shape[0], token_ids.shape[1]
    if n == 0:
        return
    r = rows.long()
    counts.index_fill_(0, r, 0)
    prompt_mask.index_fill_(0, r, 0)
    if max_len == 0:
        return
    num_chunks = min(triton.cdiv(max_len, _BLOCK_L), _MAX_CHUNKS)
    _fill_counts_kernel[(n, num_chunks)](
        rows.contiguous(), token_ids, token_ids.stride(0), prompt_len.contiguous(), num_tokens.contiguous(), counts,
        prompt_mask, counts.shape[1], prompt_mask.shape[1], max_len, BLOCK_L=_BLOCK_L, NUM_CHUNKS=num_chunks,
    )


def fill_counts(rows: Tensor, token_ids: Tensor, prompt_len: Tensor, num_tokens: Tensor, pen: PenaltyCounts,
                use_triton: bool) -> None:
    """Rebuild the statistics of `rows` [N] int32 (distinct) from token_ids[row, :num_tokens[row]]: the prompt
    positions (< prompt_len) set bits, the output positions count. A preempted and resumed request, or a request
    admitted with outputs already known, gets its outputs counted here. Ids outside [0, V) are ignored."""
    fn = fill_counts_triton if use_triton else fill_counts_ref
    fn(rows, token_ids, prompt_len, num_tokens, pen.output_counts, pen.prompt_mask)


# ---------------------------------------------------------------------------------------------------------------
# the verify step's hook: add each row's emitted run
# ---------------------------------------------------------------------------------------------------------------


def add_output_counts(
    idx_mapping: Tensor,  # [B] int32 distinct rows
    tokens: Tensor,  # [B, W] int32 tokens appended to each row this step
    num_new: Tensor,  # [B] int32 or int64: how many of tokens[b] were appended (<= W)
    pen: PenaltyCounts,
) -> None:
    """output_counts[row, tokens[b, j]] += 1 for j < num_new[b] of rows that use a penalty; a fixed-shape index_put
    (rows without penalties add 0), so it records into a CUDA graph. Plain PyTorch: no Triton kernel. The plain
    decode's update is fused into state_kernels.post_update instead."""
    b, w = tokens.shape
    if b == 0 or w == 0:
        return
    vocab = pen.vocab_size
    rows = idx_mapping.long()  # [B] int64
    active = (pen.repetition[rows] != 1.0) | (pen.presence[rows] != 0.0) | (pen.frequency[rows] != 0.0)  # [B]
    j = torch.arange(w, device=tokens.device)[None, :]  # [1, W] int64
    tok = tokens.long()  # [B, W] int64
    add = (j < num_new[:, None]) & active[:, None] & (tok >= 0) & (tok < vocab)  # [B, W] bool
    pen.output_counts.index_put_((rows[:, None].expand(b, w), tok.clamp(0, vocab - 1)), add.to(torch.int32),
                                 accumulate=True)
