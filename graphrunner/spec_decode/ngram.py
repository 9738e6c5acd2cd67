"""Prompt-lookup ("n-gram") draft proposal over the device token history, as vLLM's method="ngram".

For each scheduled request the last n tokens (n from max_n down to min_n) are looked up EARLIER in its own
history; the k tokens after the EARLIEST occurrence become its drafts. A Triton kernel (one program per
request, looping over the history in blocks) and a PyTorch reference; neither synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check

_BLOCK = 256  # candidate match starts tested per loop iteration of one program


def _check_args(
    idx_mapping: Tensor, token_ids: Tensor, num_tokens: Tensor, min_n: int, max_n: int, k: int,
) -> None:
    dev = idx_mapping.device
    _check(idx_mapping, "idx_mapping", torch.int32, 1, dev)
    _check(token_ids, "token_ids", torch.int32, 2, dev)
    _check(num_tokens, "num_tokens", torch.int32, 1, dev)
    if num_tokens.shape[0] != token_ids.shape[0]:
        raise ValueError(f"row counts differ: token_ids {token_ids.shape[0]}, num_tokens {num_tokens.shape[0]}")
    if token_ids.stride(1) != 1:
        raise ValueError("token_ids must have unit stride along its last dimension")
    for name, v in (("min_n", min_n), ("max_n", max_n), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if min_n > max_n:
        raise ValueError(f"min_n ({min_n}) must be <= max_n ({max_n})")


def _check_out(out: tuple[Tensor, Tensor], num_reqs: int, k: int, dev: torch.device) -> None:
    drafts, num_drafts = out
    _check(drafts, "out drafts", torch.int32, 2, dev)
    _check(num_drafts, "out num_drafts", torch.int32, 1, dev)
    if tuple(drafts.shape) != (num_reqs, k) or num_drafts.shape[0] != num_reqs:
        raise ValueError(f"out must be ([{num_reqs}, {k}], [{num_reqs}]), got {tuple(drafts.shape)}, "
                         f"{tuple(num_drafts.shape)}")
    if drafts.stride(1) != 1 or not num_drafts.is_contiguous():
        raise ValueError("out drafts must have unit stride along its last dimension and out num_drafts be contiguous")


def propose_ngram_ref(
    idx_mapping: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32
    num_tokens: Tensor,  # [R] int32
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of propose_ngram: every candidate start of every n is compared at once (unfold)."""
    _check_args(idx_mapping, token_ids, num_tokens, min_n, max_n, k)
    dev = idx_mapping.device
    num_reqs, max_len = idx_mapping.shape[0], token_ids.shape[1]
    rows = idx_mapping.long()  # [B] int64
    tok = token_ids[rows]  # [B, L] int32
    nt = num_tokens[rows].long().clamp(0, max_len)  # [B] int64
    match = torch.full((num_reqs,), -1, dtype=torch.int64, device=dev)  # [B] int64 start of the chosen match
    match_n = torch.zeros(num_reqs, dtype=torch.int64, device=dev)  # [B] int64 its n-gram length
    for n in range(max_n, min_n - 1, -1):
        if n >= max_len:  # shape-based: a match needs n + 1 <= num_tokens <= L tokens
            continue
        j = torch.arange(n, device=dev)  # [n] int64
        pattern = tok.gather(1, (nt[:, None] - n + j).clamp(min=0))  # [B, n] int32, last n tokens
        windows = tok.unfold(1, n, 1)  # [B, L - n + 1, n] int32, windows[b, s] = tok[b, s : s + n]
        starts = torch.arange(max_len - n + 1, device=dev)  # [L - n + 1] int64
        hit = (windows == pattern[:, None, :]).all(-1) & (starts[None, :] < (nt - n)[:, None])  # [B, L - n + 1]
        first = torch.where(hit, starts[None, :], max_len).amin(-1)  # [B] int64, L: no match
        take = (match < 0) & (first < max_len)  # [B] bool: no longer n matched, this one does
        match = torch.where(take, first, match)
        match_n = torch.where(take, n, match_n)
    num_drafts = torch.where(match >= 0, torch.clamp(nt - match - match_n, max=k), 0)  # [B] int64
    i = torch.arange(k, device=dev)  # [k] int64
    src = (match + match_n)[:, None] + i  # [B, k] int64
    drafts = tok.gather(1, src.clamp(0, max_len - 1)) if max_len else torch.zeros_like(src, dtype=torch.int32)
    drafts = torch.where(i[None, :] < num_drafts[:, None], drafts, -1)  # [B, k] int32
    return drafts.to(torch.int32), num_drafts.to(torch.int32)


@triton.jit
def _propose_ngram_kernel(
    idx_mapping_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    token_ids_stride,
    num_tokens_ptr,  # [R] int32
    drafts_ptr,  # [B, k] int32
    drafts_stride,
    num_drafts_ptr,  # [B] int32
    max_len,
    min_n,
    max_n,
    k,
    BLOCK: tl.constexpr,
    K_PAD: tl.constexpr,
):
    # One program per request: for n = max_n .. min_n (stopping at the first n that matches), scan candidate
    # starts s in [0, num_tokens - n) block by block, stopping at the first block holding a match (its
    # smallest s is the earliest match). `limit` is 0 once an n has matched, so the remaining n do no work.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    tok_row = token_ids_ptr + row * token_ids_stride
    nt = tl.minimum(tl.maximum(tl.load(num_tokens_ptr + row), 0), max_len)
    match = nt * 0 - 1  # int32 start of the chosen match, -1: none
    match_n = nt * 0  # int32 length of the chosen n-gram
    for i in range(max_n - min_n + 1):
        n = max_n - i
        limit = tl.where(match < 0, nt - n, 0)  # candidate starts: [0, limit)
        first = limit  # earliest match start found so far; == limit: none yet
        s0 = nt * 0
        while (s0 < limit) & (first == limit):
            s = s0 + offs
            ok = s < limit
            for j in range(n):
                p = tl.load(tok_row + (nt - n + j))  # pattern token j (limit > 0, so nt - n + j >= 1)
                t = tl.load(tok_row + s + j, mask=ok, other=0)
                ok = ok & (t == p)
            first = tl.minimum(first, tl.min(tl.where(ok, s, limit), axis=0))
            s0 += BLOCK
        found = first < limit
        match = tl.where(found, first, match)
        match_n = tl.where(found, n, match_n)
    nd = tl.where(match >= 0, tl.minimum(nt - match - match_n, k), 0)
    ko = tl.arange(0, K_PAD)
    d = tl.load(tok_row + match + match_n + ko, mask=ko < nd, other=-1)
    tl.store(drafts_ptr + pid.to(tl.int64) * drafts_stride + ko, d, mask=ko < k)
    tl.store(num_drafts_ptr + pid, nd)


def propose_ngram_triton(
    idx_mapping: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32
    num_tokens: Tensor,  # [R] int32
    min_n: int,
    max_n: int,
    k: int,
    out: tuple[Tensor, Tensor] | None = None,
    block: int = _BLOCK,
) -> tuple[Tensor, Tensor]:
    """Triton version of propose_ngram: one launch of B programs (into `out` when given); `block` (a power of
    two) is the number of candidate starts each loop iteration tests."""
    _check_args(idx_mapping, token_ids, num_tokens, min_n, max_n, k)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block!r}")
    dev = idx_mapping.device
    num_reqs = idx_mapping.shape[0]
    if out is None:
        out = (torch.empty(num_reqs, k, dtype=torch.int32, device=dev),  # [B, k] int32
               torch.empty(num_reqs, dtype=torch.int32, device=dev))  # [B] int32
    _check_out(out, num_reqs, k, dev)
    drafts, num_drafts = out
    if num_reqs == 0:
        return drafts, num_drafts
    _propose_ngram_kernel[(num_reqs,)](
        idx_mapping.contiguous(), token_ids, token_ids.stride(0), num_tokens.contiguous(), drafts, drafts.stride(0),
        num_drafts, token_ids.shape[1], min_n, max_n, k, BLOCK=block, K_PAD=triton.next_power_of_2(k),
    )
    return drafts, num_drafts


def propose_ngram(
    idx_mapping: Tensor,  # [B] int32 state-table row of the b-th request (rows may repeat, e.g. padding)
    token_ids: Tensor,  # [R, L] int32 persistent token history (prompt + generated)
    num_tokens: Tensor,  # [R] int32 valid length of each row's history
    min_n: int,  # prompt_lookup_min
    max_n: int,  # prompt_lookup_max
    k: int,  # num_speculative_tokens
    use_triton: bool,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Propose up to k draft tokens per request by prompt lookup; returns (drafts [B, k] int32, num_drafts [B]
    int32), written into `out` when given.

    With h = token_ids[row, :num_tokens[row]] (num_tokens clamped to [0, L]): for n = max_n down to min_n, the
    pattern is h[-n:]; its EARLIEST occurrence h[s : s + n] with s < len(h) - n (not the suffix itself,
    overlaps allowed) wins, and the first n that has one stops the search (longer n-grams first). Then
    num_drafts = min(k, len(h) - s - n) (>= 1) and drafts[b, :num_drafts] = h[s + n : s + n + num_drafts].
    No match (e.g. len(h) <= min_n): num_drafts = 0. Unused draft slots hold -1. The caller caps drafts to the
    row's free room or max_model_len if it needs to. Precondition (unchecked, it would sync): every
    idx_mapping entry is a valid row. Rows not named in idx_mapping are never read.
    """
    args = (idx_mapping, token_ids, num_tokens, min_n, max_n, k)
    if use_triton:
        return propose_ngram_triton(*args, out=out)
    drafts, num_drafts = propose_ngram_ref(*args)
    if out is None:
        return drafts, num_drafts
    _check_out(out, idx_mapping.shape[0], k, idx_mapping.device)
    out[0].copy_(drafts)
    out[1].copy_(num_drafts)
    return out
