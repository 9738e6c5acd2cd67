"""The verify step's rejection sampler with the vocabulary split across programs, and `rejection_sample`, the
dispatcher between it, rejection.py's one-program-per-request kernel and the PyTorch reference.

A (request, row, vocab chunk) program writes its chunk's partials: the plain pick (argmax, or Gumbel-max of the
tempered logits), the residual pick (the same without the draft token) and the softmax max / sum of a sampled
draft row. One program per request then walks its rows on those partials until the first rejection. The
one-program walk over whole rows cost ~80 µs per row at a 152K vocabulary, one row after another (k = 4 verifies
up to 5). Picks equal rejection.py's (exact maxima, lowest index on ties); one-hot q (draft_probs None) only.
On by default (H200: 9 µs against the walk's 564 µs in a k = 4 verify step); GRAPHRUNNER_SPLIT_REJECTION=0 restores
the walk (docs/DECISIONS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.env import env_choice
from graphrunner.kernel_checks import step_sizes
from graphrunner.sampling.gumbel import _gumbel, _row_keys
from graphrunner.sampling.gumbel_split import _BLOCK_V, chunk_pad, split_plan
from graphrunner.sampling.rejection import (
    _accept_uniform,
    _argmax_update,
    _check_args,
    _draft_prob,
    _online_softmax,
    _request_header,
    rejection_sample_ref,
    rejection_sample_triton,
)

# read once at import, for A/B runs: "1" (default) this split kernel wherever q is one-hot, "0" the
# one-program-per-request walk
SPLIT_REJECTION_ENABLED: bool = env_choice("GRAPHRUNNER_SPLIT_REJECTION", ("0", "1"), "1") == "1"
_NF, _NI = 4, 2  # float partials per (row, chunk): plain max, residual max, softmax max, softmax sum; int: the two picks


@triton.jit(do_not_specialize=step_sizes("stride_draft", "k1", "chunk", "num_chunks"))
def _rejection_partial_kernel(
    logits_ptr,  # [N, V] float32, unit stride along V
    stride_logits,
    cu_ptr,  # [B + 1] int32: request b owns logits rows cu[b] .. cu[b + 1] - 1
    draft_ids_ptr,  # [B, K] int32
    stride_draft,
    num_drafts_ptr,  # [B] int32
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64: position of the request's first logits row
    part_f_ptr,  # [B, K + 1, C, _NF] float32
    part_i_ptr,  # [B, K + 1, C, _NI] int32
    vocab_size,
    k1,  # K + 1
    chunk,  # vocab entries per program, a multiple of BLOCK_V
    num_chunks,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    c = tl.program_id(2)
    first, n, temp, greedy, seed, pos0 = _request_header(b, cu_ptr, num_drafts_ptr, temperature_ptr, seeds_ptr,
                                                         positions_ptr)
    if j < tl.load(cu_ptr + b + 1) - first:
        key1, key2 = _row_keys(seed, pos0 + j)
        is_draft = j < n
        d = tl.load(draft_ids_ptr + b.to(tl.int64) * stride_draft + j, mask=is_draft, other=-1)
        softmax = is_draft & (greedy == 0)  # a sampled draft row: the walk needs p(d)
        row_ptr = logits_ptr + (first + j).to(tl.int64) * stride_logits
        start = c * chunk
        end = tl.minimum(start + chunk, vocab_size)
        best_val = tl.full((), float("-inf"), tl.float32)
        best_idx = start  # every chunk is non-empty: `start` is a valid token even for an all -inf chunk
        res_val = tl.full((), float("-inf"), tl.float32)
        res_idx = start
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for v0 in range(start, end, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            msk = offs < end
            x = tl.load(row_ptr + offs, mask=msk, other=float("-inf"))
            if greedy:
                plain = x
            else:
                plain = x / temp + _gumbel(offs, key1, key2)
            plain = tl.where(msk & (tl.abs(plain) <= float("inf")), plain, float("-inf"))  # NaN never wins
            best_val, best_idx = _argmax_update(plain, v0, best_val, best_idx)
            res_val, res_idx = _argmax_update(tl.where(offs == d, float("-inf"), plain), v0, res_val, res_idx)
            if softmax:  # online max and sum of exp(x / temp - m), as rejection._softmax_stats
                m, s = _online_softmax(m, s, x / temp)
        cell = (b.to(tl.int64) * k1 + j) * num_chunks + c
        tl.store(part_f_ptr + cell * 4 + 0, best_val)
        tl.store(part_f_ptr + cell * 4 + 1, res_val)
        tl.store(part_f_ptr + cell * 4 + 2, m)
        tl.store(part_f_ptr + cell * 4 + 3, s)
        tl.store(part_i_ptr + cell * 2 + 0, best_idx)
        tl.store(part_i_ptr + cell * 2 + 1, res_idx)


@triton.jit
def _pick_of(part_f_ptr, part_i_ptr, cell0, offs, msk, WHICH: tl.constexpr):
    # the row's pick (WHICH 0: plain, 1: residual) over its chunks, chunks in vocab order: the lowest index on ties
    vals = tl.load(part_f_ptr + (cell0 + offs) * 4 + WHICH, mask=msk, other=float("-inf"))
    idxs = tl.load(part_i_ptr + (cell0 + offs) * 2 + WHICH, mask=msk, other=0)
    best = tl.argmax(vals, axis=0)
    return tl.max(vals, axis=0), tl.sum(tl.where(offs == best, idxs, 0), axis=0)


@triton.jit(do_not_specialize=step_sizes("stride_draft", "stride_out", "k1", "num_chunks"))
def _rejection_walk_kernel(
    logits_ptr,  # [N, V] float32, unit stride along V
    stride_logits,
    cu_ptr,  # [B + 1] int32
    draft_ids_ptr,  # [B, K] int32
    stride_draft,
    num_drafts_ptr,  # [B] int32
    temperature_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64
    part_f_ptr,  # [B, K + 1, C, _NF] float32
    part_i_ptr,  # [B, K + 1, C, _NI] int32
    out_ptr,  # [B, K + 1] int32, pre-filled with -1
    stride_out,
    num_accepted_ptr,  # [B] int32
    vocab_size,
    k1,
    num_chunks,
    C_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    first, n, temp, greedy, seed, pos0 = _request_header(b, cu_ptr, num_drafts_ptr, temperature_ptr, seeds_ptr,
                                                         positions_ptr)
    offs = tl.arange(0, C_PAD)
    msk = offs < num_chunks
    j = tl.full((), 0, tl.int32)
    go = tl.full((), 1, tl.int32)
    while go != 0:
        cell0 = (b.to(tl.int64) * k1 + j) * num_chunks
        _, plain_tok = _pick_of(part_f_ptr, part_i_ptr, cell0, offs, msk, 0)
        is_draft = j < n
        d = tl.load(draft_ids_ptr + b.to(tl.int64) * stride_draft + j, mask=is_draft, other=-1)
        sampled_draft = is_draft & (greedy == 0)
        tok = plain_tok
        acc_s = tl.full((), 0, tl.int32)
        if sampled_draft:  # accept with probability min(1, p(d)) (one-hot q): u < p(d)
            ms = tl.load(part_f_ptr + (cell0 + offs) * 4 + 2, mask=msk, other=float("-inf"))
            ss = tl.load(part_f_ptr + (cell0 + offs) * 4 + 3, mask=msk, other=0.0)
            mx = tl.max(ms, axis=0)
            safe = tl.where(mx == float("-inf"), 0.0, mx)
            total = tl.sum(ss * tl.exp(ms - safe), axis=0)
            p_d = _draft_prob(logits_ptr + (first + j) * stride_logits, d, vocab_size, temp, mx, total)
            key1, key2 = _row_keys(seed, pos0 + j)
            acc_s = (_accept_uniform(key1, key2) < p_d).to(tl.int32)
            res_best, res_tok = _pick_of(part_f_ptr, part_i_ptr, cell0, offs, msk, 1)
            # rejected: the residual max(0, p - q) is p without d; empty (all -inf) falls back to the plain pick
            tok = tl.where(acc_s != 0, d, tl.where(res_best == float("-inf"), plain_tok, res_tok))
        accept = is_draft & tl.where(greedy, tok == d, acc_s != 0)
        tl.store(out_ptr + b.to(tl.int64) * stride_out + j, tl.where(accept, d, tok))
        j += accept.to(tl.int32)
        go = accept.to(tl.int32)
    tl.store(num_accepted_ptr + b, j)


def rejection_sample_split_triton(
    logits: Tensor, cu_num_logits: Tensor, draft_ids: Tensor, num_drafts: Tensor, temperature: Tensor,
    seeds: Tensor, positions: Tensor,
) -> tuple[Tensor, Tensor]:  # output_ids [B, K + 1] int32, num_accepted [B] int32
    """rejection_sample with one-hot q and the vocabulary split across programs (see the module docstring)."""
    _check_args(logits, cu_num_logits, draft_ids, num_drafts, None, temperature, seeds, positions)
    (num_reqs, k), vocab_size = draft_ids.shape, logits.shape[1]
    dev = logits.device
    out = torch.full((num_reqs, k + 1), -1, dtype=torch.int32, device=dev)  # [B, K + 1] int32
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32, device=dev)  # [B] int32
    if num_reqs == 0:
        return out, num_accepted
    chunk, num_chunks = split_plan(num_reqs * (k + 1), vocab_size, dev)
    cells = num_reqs * (k + 1) * num_chunks
    part_f = torch.empty(cells * _NF, dtype=torch.float32, device=dev)  # [B, K + 1, C, _NF] float32
    part_i = torch.empty(cells * _NI, dtype=torch.int32, device=dev)  # [B, K + 1, C, _NI] int32
    draft_ids, cu = draft_ids.contiguous(), cu_num_logits.contiguous()  # [B, K] int32 unit stride along K; [B + 1]
    temperature, seeds, positions = temperature.contiguous(), seeds.contiguous(), positions.contiguous()
    num_drafts = num_drafts.contiguous()
    _rejection_partial_kernel[(num_reqs, k + 1, num_chunks)](
        logits, logits.stride(0), cu, draft_ids, draft_ids.stride(0), num_drafts, temperature, seeds, positions,
        part_f, part_i, vocab_size, k + 1, chunk, num_chunks, BLOCK_V=_BLOCK_V, num_warps=4,
    )
    _rejection_walk_kernel[(num_reqs,)](
        logits, logits.stride(0), cu, draft_ids, draft_ids.stride(0), num_drafts, temperature, seeds, positions,
        part_f, part_i, out, out.stride(0), num_accepted, vocab_size, k + 1, num_chunks,
        C_PAD=chunk_pad(vocab_size), num_warps=1,
    )
    return out, num_accepted


def rejection_sample(
    logits: Tensor,  # [N, V] float32, N = sum(1 + k_b): each request's k_b draft rows, then its bonus row
    cu_num_logits: Tensor,  # [B + 1] int32
    draft_ids: Tensor,  # [B, K] int32
    num_drafts: Tensor,  # [B] int32
    draft_probs: Tensor | None,  # [N_drafts, V] float32, or None for greedy drafts (one-hot q)
    temperature: Tensor,  # [B] float32, 0 = greedy
    seeds: Tensor,  # [B] int64
    positions: Tensor,  # [B] int64; row j of request b uses the RNG position positions[b] + j
    use_triton: bool,
) -> tuple[Tensor, Tensor]:  # output_ids [B, K + 1] int32 (-1 unused), num_accepted [B] int32
    """Verify drafts: request b emits output_ids[b, :num_accepted[b] + 1] (accepted drafts, then one corrected
    or bonus token). Seeded results depend only on (seed, position), not on the batch. The split kernel serves
    one-hot q (GRAPHRUNNER_SPLIT_REJECTION=0: the walk); a draft distribution always goes to rejection.py's
    kernel."""
    if not use_triton:
        return rejection_sample_ref(logits, cu_num_logits, draft_ids, num_drafts, draft_probs, temperature, seeds,
                                    positions)
    if draft_probs is None and SPLIT_REJECTION_ENABLED:
        return rejection_sample_split_triton(logits, cu_num_logits, draft_ids, num_drafts, temperature, seeds,
                                             positions)
    return rejection_sample_triton(logits, cu_num_logits, draft_ids, num_drafts, draft_probs, temperature, seeds,
                                   positions)
