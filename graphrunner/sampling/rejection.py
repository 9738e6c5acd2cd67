"""Speculative decoding's verification step (vLLM's rejection sampler) on graphrunner's stateless RNG: the
one-program-per-request Triton kernel (any q) and the PyTorch reference; rejection_split.py holds the split-vocab
kernel and the dispatcher `rejection_sample`.

Greedy requests accept drafts while they equal the target argmax; sampled ones accept d with probability
min(1, p(d) / q(d)) and resample the first rejected row from max(0, p - q) by Gumbel-max, so emitted tokens follow p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check
from graphrunner.kernel_checks import step_sizes
from graphrunner.sampling.gumbel import (
    _BLOCK_V,
    _U_SCALE,
    _gumbel,
    _mix32,
    _mix32_ref,
    _row_keys,
    _row_keys_ref,
    gumbel_noise_ref,
)

# Salt of the acceptance uniform: hashed where a vocab index would go, but >= 2**31 so it is never one; the uniform
# is thus independent of the row's Gumbel noise (vLLM-style acceptance needs u independent of the resampling).
_ACCEPT_SALT = 0xC2B2AE35

# ---------------------------------------------------------------------------------------------------------------
# Triton kernel: one program per request, walking its rows until the first rejection.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _accept_uniform(k1, k2):
    # k1, k2: uint32 row keys; returns a float32 uniform in (0, 1).
    h = _mix32(_mix32(k1 ^ 0xC2B2AE35) ^ k2)  # _ACCEPT_SALT
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


@triton.jit
def _request_header(b, cu_ptr, num_drafts_ptr, temperature_ptr, seeds_ptr, positions_ptr):
    # request b's first logits row (int64), draft count, temperature (1 when greedy), greedy flag, seed and the RNG
    # position of its first row
    temp = tl.load(temperature_ptr + b)
    greedy = temp == 0.0
    return (tl.load(cu_ptr + b).to(tl.int64), tl.load(num_drafts_ptr + b), tl.where(greedy, 1.0, temp), greedy,
            tl.load(seeds_ptr + b), tl.load(positions_ptr + b))


@triton.jit
def _online_softmax(m, s, z):
    # one block z into the online max m and sum s of exp(z - m); rows of -inf keep (-inf, 0) without NaN
    new_m = tl.maximum(m, tl.max(z, axis=0))
    safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
    return new_m, s * tl.exp(m - safe_m) + tl.sum(tl.exp(z - safe_m), axis=0)


@triton.jit
def _draft_prob(row_ptr, d, vocab_size, temp, m, s):
    # p(d) = exp(x_d / temp - m) / s; a draft outside the vocabulary gets 0 (NaN on an all -inf row: never accepted)
    in_vocab = (d >= 0) & (d < vocab_size)
    return tl.exp(tl.load(row_ptr + d, mask=in_vocab, other=float("-inf")) / temp - m) / s


@triton.jit
def _softmax_stats(row_ptr, vocab_size, temp, BLOCK_V: tl.constexpr):
    # Online max m and sum s of exp(x / temp - m) over the row; rows of -inf give (-inf, 0) without NaN.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m, s = _online_softmax(m, s, tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")) / temp)
    return m, s


@triton.jit
def _argmax_update(val, v0, best_val, best_idx):
    blk_max = tl.max(val, axis=0)
    blk_idx = tl.argmax(val, axis=0).to(tl.int32) + v0
    better = blk_max > best_val  # strict: the earlier block keeps ties (lowest index wins)
    return tl.where(better, blk_max, best_val), tl.where(better, blk_idx, best_idx)


@triton.jit
def _pick(row_ptr, q_row_ptr, vocab_size, temp, greedy, k1, k2, d, residual, m, s,
          HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    # residual == 0: Gumbel-max of x / temp (argmax of x when greedy), exactly gumbel._sample_kernel's value.
    # residual != 0: Gumbel-max of log(max(0, p - q)) (one-hot q: x / temp with d removed); if that is empty
    # (every entry -inf), fall back to the plain sample.
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    alt_val = tl.full((), float("-inf"), tl.float32)
    alt_idx = tl.full((), 0, tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        msk = offs < vocab_size
        x = tl.load(row_ptr + offs, mask=msk, other=float("-inf"))
        g = _gumbel(offs, k1, k2)
        plain = tl.where(greedy, x, x / temp + g)
        if HAS_Q:
            q = tl.load(q_row_ptr + offs, mask=offs < tl.where(residual, vocab_size, 0), other=0.0)
            res = tl.log(tl.maximum(tl.exp(x / temp - m) / s - q, 0.0)) + g
        else:
            res = tl.where(offs == d, float("-inf"), plain)
        val = tl.where(msk, tl.where(residual, res, plain), float("-inf"))
        plain = tl.where(msk, plain, float("-inf"))
        best_val, best_idx = _argmax_update(val, v0, best_val, best_idx)
        alt_val, alt_idx = _argmax_update(plain, v0, alt_val, alt_idx)
    return tl.where(best_val == float("-inf"), alt_idx, best_idx)


@triton.jit(do_not_specialize=step_sizes("stride_draft", "stride_out"))  # K and K + 1: the step's most drafts
def _rejection_kernel(
    logits_ptr,  # [N, V] float32, unit stride along V
    stride_logits,
    cu_ptr,  # [B + 1] int32: request b owns logits rows cu[b] .. cu[b + 1] - 1
    draft_ids_ptr,  # [B, K] int32
    stride_draft,
    num_drafts_ptr,  # [B] int32
    q_ptr,  # [N_drafts, V] float32 when HAS_Q (draft j of request b is row cu[b] - b + j), else unused
    stride_q,
    temperature_ptr,  # [B] float32, 0 = greedy
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64: position of the request's first logits row
    out_ptr,  # [B, K + 1] int32, pre-filled with -1
    stride_out,
    num_accepted_ptr,  # [B] int32
    vocab_size,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    first, n, temp, greedy, seed, pos0 = _request_header(b, cu_ptr, num_drafts_ptr, temperature_ptr, seeds_ptr,
                                                         positions_ptr)
    j = tl.full((), 0, tl.int32)
    go = tl.full((), 1, tl.int32)
    while go != 0:
        row_ptr = logits_ptr + (first + j) * stride_logits
        q_row_ptr = q_ptr + (first - b + j) * stride_q
        k1, k2 = _row_keys(seed, pos0 + j)
        is_draft = j < n
        d = tl.load(draft_ids_ptr + b.to(tl.int64) * stride_draft + j, mask=is_draft, other=-1)
        in_vocab = (d >= 0) & (d < vocab_size)
        sampled_draft = is_draft & (greedy == 0)
        m = tl.full((), 0.0, tl.float32)
        s = tl.full((), 1.0, tl.float32)
        acc_s = tl.full((), 0, tl.int32)
        if sampled_draft:  # accept with probability min(1, p(d) / q(d)): u * q(d) < p(d)
            m, s = _softmax_stats(row_ptr, vocab_size, temp, BLOCK_V)
            p_d = _draft_prob(row_ptr, d, vocab_size, temp, m, s)
            if HAS_Q:
                q_d = tl.load(q_row_ptr + d, mask=in_vocab, other=0.0)
            else:
                q_d = 1.0
            acc_s = (_accept_uniform(k1, k2) * q_d < p_d).to(tl.int32)
        tok = d
        if (sampled_draft == 0) | (acc_s == 0):
            tok = _pick(row_ptr, q_row_ptr, vocab_size, temp, greedy, k1, k2, d, sampled_draft, m, s,
                        HAS_Q, BLOCK_V)
        accept = is_draft & tl.where(greedy, tok == d, acc_s != 0)
        tl.store(out_ptr + b.to(tl.int64) * stride_out + j, tl.where(accept, d, tok))
        j += accept.to(tl.int32)
        go = accept.to(tl.int32)
    tl.store(num_accepted_ptr + b, j)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks, the PyTorch reference, the launcher and the dispatcher.
# ---------------------------------------------------------------------------------------------------------------


def _check_args(logits: Tensor, cu_num_logits: Tensor, draft_ids: Tensor, num_drafts: Tensor,
                draft_probs: Tensor | None, temperature: Tensor, seeds: Tensor, positions: Tensor) -> None:
    dev = logits.device
    _check(logits, "logits", torch.float32, 2, dev)
    _check(cu_num_logits, "cu_num_logits", torch.int32, 1, dev)
    _check(draft_ids, "draft_ids", torch.int32, 2, dev)
    _check(num_drafts, "num_drafts", torch.int32, 1, dev)
    _check(temperature, "temperature", torch.float32, 1, dev)
    _check(seeds, "seeds", torch.int64, 1, dev)
    _check(positions, "positions", torch.int64, 1, dev)
    num_reqs, vocab_size = draft_ids.shape[0], logits.shape[1]
    if vocab_size < 1 or (vocab_size > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must have a vocab dimension >= 1 with unit stride, got {tuple(logits.shape)}")
    if cu_num_logits.shape[0] != num_reqs + 1:
        raise ValueError(f"cu_num_logits has {cu_num_logits.shape[0]} entries, expected {num_reqs + 1}")
    for name, t in (("num_drafts", num_drafts), ("temperature", temperature), ("seeds", seeds),
                    ("positions", positions)):
        if t.shape[0] != num_reqs:
            raise ValueError(f"{name} has {t.shape[0]} entries, draft_ids has {num_reqs} rows")
    if logits.shape[0] < num_reqs:
        raise ValueError(f"logits has {logits.shape[0]} rows, fewer than the {num_reqs} requests")
    if draft_probs is not None:
        _check(draft_probs, "draft_probs", torch.float32, 2, dev)
        if draft_probs.shape[1] != vocab_size or (vocab_size > 1 and draft_probs.stride(1) != 1):
            raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must be [N_drafts, {vocab_size}], unit stride")


def _row_layout(cu_num_logits: Tensor, draft_ids: Tensor, num_drafts: Tensor,
                num_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per logits row: (request [N] int64, index j in the request [N] int64, draft token or -1 [N] int64,
    is a draft row [N] bool, valid [N] bool); rows past cu_num_logits[B] are invalid (padding). Needs B >= 1."""
    num_reqs, k = draft_ids.shape
    r = torch.arange(num_rows, dtype=torch.int64, device=draft_ids.device)  # [N] int64
    cu = cu_num_logits.long()  # [B + 1] int64
    req = torch.searchsorted(cu[1:].contiguous(), r, right=True)  # [N] int64 in [0, B]
    valid = req < num_reqs
    req = req.clamp(max=num_reqs - 1)
    j = r - cu[req]  # [N] int64
    is_draft = valid & (j < num_drafts.long()[req])
    d = draft_ids.long()[req, j.clamp(0, max(k - 1, 0))] if k > 0 else torch.full_like(r, -1)
    return req, j, torch.where(is_draft, d, -1), is_draft, valid


def _accept_uniform_ref(seeds: Tensor, positions: Tensor) -> Tensor:  # [n] float32
    k1, k2 = _row_keys_ref(seeds, positions)
    h = _mix32_ref(_mix32_ref(k1 ^ _ACCEPT_SALT) ^ k2)
    return ((h >> 9).to(torch.float32) + 0.5) * _U_SCALE


def _row_decisions_ref(x: Tensor, q: Tensor | None, temp: Tensor, seeds: Tensor, pos: Tensor, d: Tensor,
                       is_draft: Tensor) -> tuple[Tensor, Tensor]:
    """For rows x [n, V] (temp [n], 0 = greedy; d [n] int64 draft token where is_draft [n] bool): (token to emit if
    the walk stops at this row [n] int64, draft accepted [n] bool)."""
    vocab_size = x.shape[1]
    greedy = temp == 0.0  # [n] bool
    t = torch.where(greedy, torch.ones_like(temp), temp)[:, None]  # [n, 1] float32
    g = gumbel_noise_ref(seeds, pos, vocab_size)  # [n, V] float32
    plain = torch.where(greedy[:, None], x, x / t + g)  # [n, V] float32
    plain_tok = plain.argmax(dim=-1)  # [n] int64
    z = x / t
    m = z.amax(dim=-1, keepdim=True)  # [n, 1]
    s = torch.exp(z - m).sum(dim=-1, keepdim=True)  # [n, 1]
    p = torch.exp(z - m) / s  # [n, V] float32
    in_vocab = (d >= 0) & (d < vocab_size)
    dc = d.clamp(0, vocab_size - 1)[:, None]  # [n, 1] int64
    p_d = torch.where(in_vocab, p.gather(1, dc)[:, 0], 0.0)  # [n] float32
    if q is None:
        q_d = torch.ones_like(p_d)
        res = plain.masked_fill(torch.arange(vocab_size, device=x.device)[None, :] == d[:, None], float("-inf"))
    else:
        q_d = torch.where(in_vocab, q.gather(1, dc)[:, 0], 0.0)
        res = torch.log(torch.clamp(p - q, min=0.0)) + g  # [n, V] float32
    res_tok = torch.where(res.amax(dim=-1) == float("-inf"), plain_tok, res.argmax(dim=-1))  # [n] int64
    acc_s = _accept_uniform_ref(seeds, pos) * q_d < p_d  # [n] bool
    tok = torch.where(is_draft & ~greedy, res_tok, plain_tok)
    return tok, is_draft & torch.where(greedy, plain_tok == d, acc_s)


def rejection_sample_ref(
    logits: Tensor,  # [N, V] float32, N = sum(1 + k_b), request after request
    cu_num_logits: Tensor,  # [B + 1] int32
    draft_ids: Tensor,  # [B, K] int32, slots >= k_b unused
    num_drafts: Tensor,  # [B] int32, k_b <= K
    draft_probs: Tensor | None,  # [N_drafts, V] float32 (q), None = one-hot q on the draft token (n-gram)
    temperature: Tensor,  # [B] float32, 0 = greedy
    seeds: Tensor,  # [B] int64
    positions: Tensor,  # [B] int64, position of each request's first logits row
) -> tuple[Tensor, Tensor]:  # output_ids [B, K + 1] int32 (-1 unused), num_accepted [B] int32
    """PyTorch reference of rejection_sample: decides every row (in chunks), then keeps each request's prefix."""
    _check_args(logits, cu_num_logits, draft_ids, num_drafts, draft_probs, temperature, seeds, positions)
    (num_rows, vocab_size), (num_reqs, k) = logits.shape, draft_ids.shape
    dev = logits.device
    if num_reqs == 0:  # shape-based branch
        return torch.empty(0, k + 1, dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.int32, device=dev)
    req, j, d, is_draft, valid = _row_layout(cu_num_logits, draft_ids, num_drafts, num_rows)
    tok = torch.empty(num_rows, dtype=torch.int64, device=dev)  # [N] int64
    acc = torch.empty(num_rows, dtype=torch.bool, device=dev)  # [N] bool
    chunk = max(1, (1 << 21) // vocab_size)
    for s in range(0, num_rows, chunk):
        e = min(s + chunk, num_rows)
        q = None
        if draft_probs is not None and draft_probs.shape[0] > 0:  # draft j of request b: row cu[b] - b + j
            q_rows = (torch.arange(s, e, device=dev) - req[s:e]).clamp(0, draft_probs.shape[0] - 1)
            q = draft_probs[q_rows]  # [chunk, V] float32 (garbage on bonus rows, unused there)
        tok[s:e], acc[s:e] = _row_decisions_ref(logits[s:e], q, temperature[req[s:e]], seeds[req[s:e]],
                                                positions[req[s:e]] + j[s:e], d[s:e], is_draft[s:e])
    cells = num_reqs * (k + 1)
    flat = torch.where(valid & (j <= k), req * (k + 1) + j, cells)  # [N] int64; cell `cells` is a dump
    acc_grid = torch.zeros(cells + 1, dtype=torch.int32, device=dev).scatter_(0, flat, acc.int())
    tok_grid = torch.zeros(cells + 1, dtype=torch.int64, device=dev).scatter_(0, flat, tok)
    acc_grid, tok_grid = acc_grid[:cells].view(num_reqs, k + 1), tok_grid[:cells].view(num_reqs, k + 1)
    num_acc = torch.cumprod(acc_grid, dim=1).sum(dim=1)  # [B] int64
    col = torch.arange(k + 1, device=dev)[None, :]  # [1, K + 1]
    drafts = torch.cat([draft_ids.long(), torch.full((num_reqs, 1), -1, dtype=torch.int64, device=dev)], dim=1)
    stop_tok = tok_grid.gather(1, num_acc[:, None])  # [B, 1] int64
    out = torch.where(col < num_acc[:, None], drafts, torch.where(col == num_acc[:, None], stop_tok, -1))
    return out.to(torch.int32), num_acc.to(torch.int32)


def rejection_sample_triton(
    logits: Tensor, cu_num_logits: Tensor, draft_ids: Tensor, num_drafts: Tensor, draft_probs: Tensor | None,
    temperature: Tensor, seeds: Tensor, positions: Tensor,
) -> tuple[Tensor, Tensor]:  # output_ids [B, K + 1] int32, num_accepted [B] int32
    """Triton version of rejection_sample: one program per request, rows walked until the first rejection."""
    _check_args(logits, cu_num_logits, draft_ids, num_drafts, draft_probs, temperature, seeds, positions)
    (num_reqs, k), vocab_size = draft_ids.shape, logits.shape[1]
    out = torch.full((num_reqs, k + 1), -1, dtype=torch.int32, device=logits.device)  # [B, K + 1] int32
    num_accepted = torch.zeros(num_reqs, dtype=torch.int32, device=logits.device)  # [B] int32
    if num_reqs == 0:
        return out, num_accepted
    block_v = min(_BLOCK_V, triton.next_power_of_2(vocab_size))
    num_warps = max(4, min(16, block_v // 256))
    q = draft_probs if draft_probs is not None else logits  # a dummy pointer when HAS_Q is False
    draft_ids = draft_ids.contiguous()  # [B, K] int32, the kernel assumes unit stride along K
    _rejection_kernel[(num_reqs,)](
        logits, logits.stride(0), cu_num_logits.contiguous(), draft_ids, draft_ids.stride(0),
        num_drafts.contiguous(), q, q.stride(0), temperature.contiguous(), seeds.contiguous(),
        positions.contiguous(), out, out.stride(0), num_accepted, vocab_size,
        HAS_Q=draft_probs is not None, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out, num_accepted
