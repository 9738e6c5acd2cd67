"""Logprobs for sampled tokens and prompt tokens: top-k ids first, then ONE pass per row for the log-softmax
normaliser (online max + sum of exp) and the token's rank; logprobs are formed only for the k ids and the token.
Prompt logprobs run in chunks of positions so the [chunk, V] logits bound the memory, even inside one long prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check
from graphrunner.kernel_checks import step_sizes

MAX_NUM_TOP = 20  # the largest k accepted (vLLM's max_logprobs default)
_BLOCK_V = 4096  # vocab entries per loop iteration of one program (same block as the Gumbel sampler)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LogprobsTensors:
    top_ids: Tensor  # [N, k] int32, the k largest logits' ids, descending logit, ascending id among equal logits
    top_logprobs: Tensor  # [N, k] float32
    token_logprob: Tensor  # [N] float32, logprob of token_ids[n]
    token_rank: Tensor  # [N] int32, 1 + number of ids with a strictly larger logit (equal logits share a rank)


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces: checks and the top-k selection (both paths use the same one, so their top ids agree bit for bit).
# ---------------------------------------------------------------------------------------------------------------




def _check_num_top(num_top: int, vocab_size: int | None) -> None:
    if isinstance(num_top, bool) or not isinstance(num_top, int) or not 0 <= num_top <= MAX_NUM_TOP:
        raise ValueError(f"num_top must be an int in [0, {MAX_NUM_TOP}], got {num_top!r}")
    if vocab_size is not None and num_top > vocab_size:
        raise ValueError(f"num_top {num_top} exceeds the vocab size {vocab_size}")


def _check_inputs(logits: Tensor, token_ids: Tensor, num_top: int) -> None:
    _check(logits, "logits", _FLOAT_DTYPES, 2, logits.device)
    _check(token_ids, "token_ids", (torch.int32,), 1, logits.device)
    if logits.shape[1] < 1:
        raise ValueError("logits must have a vocab dimension of at least 1")
    if token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"token_ids has {token_ids.shape[0]} entries, logits has {logits.shape[0]} rows")
    _check_num_top(num_top, logits.shape[1])


def _top_k(logits: Tensor, num_top: int) -> tuple[Tensor, Tensor]:  # [N, k] float32, [N, k] int32
    """torch.topk, then the k entries re-sorted by (logit desc, id asc): a deterministic order among equal logits.

    Which of several equal logits straddling the k-th place get in is torch.topk's choice (the same for both paths).
    """
    vals, ids = torch.topk(logits, num_top, dim=-1, largest=True, sorted=True)  # [N, k] input dtype, [N, k] int64
    ids, perm = torch.sort(ids, dim=-1)  # ascending id
    vals = vals.gather(-1, perm)
    vals, perm = torch.sort(vals, dim=-1, descending=True, stable=True)  # stable: ascending id among equal logits
    return vals.float(), ids.gather(-1, perm).to(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch reference.
# ---------------------------------------------------------------------------------------------------------------


def compute_logprobs_ref(
    logits: Tensor,  # [N, V] float32 (bf16 / fp16 are upcast)
    token_ids: Tensor,  # [N] int32 in [0, V)
    num_top: int,
) -> LogprobsTensors:
    """PyTorch reference: a full [N, V] torch.log_softmax, gathered at the top-k ids and the token."""
    _check_inputs(logits, token_ids, num_top)
    top_vals, top_ids = _top_k(logits, num_top)  # [N, k] float32, [N, k] int32
    x = logits.float()  # [N, V] float32
    lp = torch.log_softmax(x, dim=-1)  # [N, V] float32 (NaN in an all -inf row; the where below fixes those)
    tok = token_ids.long()[:, None]  # [N, 1] int64
    tok_logit = x.gather(-1, tok)  # [N, 1] float32
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    top_lp = torch.where(top_vals == float("-inf"), neg_inf, lp.gather(-1, top_ids.long()))  # [N, k] float32
    tok_lp = torch.where(tok_logit == float("-inf"), neg_inf, lp.gather(-1, tok))  # [N, 1] float32
    rank = (x > tok_logit).sum(dim=-1) + 1  # [N] int64
    return LogprobsTensors(top_ids, top_lp, tok_lp[:, 0], rank.to(torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# Triton: one program per row, one pass over the vocab.
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=step_sizes("num_top"))
def _logprobs_kernel(
    logits_ptr,  # [N, V] float32 / bfloat16 / float16, any strides
    stride_n,
    stride_v,
    token_ids_ptr,  # [N] int32
    top_vals_ptr,  # [N, k] float32, contiguous
    top_lp_ptr,  # [N, k] float32 out
    tok_lp_ptr,  # [N] float32 out
    tok_rank_ptr,  # [N] int32 out
    vocab_size,
    num_top,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    row_ptr = logits_ptr + pid.to(tl.int64) * stride_n
    tok = tl.load(token_ids_ptr + pid)
    tok_ok = (tok >= 0) & (tok < vocab_size)  # out-of-range ids are a caller bug: never read out of bounds
    x_tok = tl.load(row_ptr + tok.to(tl.int64) * stride_v, mask=tok_ok, other=float("nan")).to(tl.float32)
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.full((), 0.0, tl.float32)  # sum of exp(x - run_max) so far
    num_greater = tl.full((), 0, tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=offs < vocab_size, other=float("-inf"))
        x = x.to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: exp(-inf - 0) = 0, never NaN
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_max = new_max
        num_greater += tl.sum((x > x_tok).to(tl.int32), axis=0)  # padding lanes are -inf: never greater
    shift = tl.where(run_max == float("-inf"), 0.0, run_max)
    log_sum = tl.log(tl.maximum(run_sum, 1.0))  # >= 1 already when any logit is finite (the max adds exp(0))
    # logprob = (x - max) - log(sum exp(x - max)), as torch.log_softmax: x - logsumexp would lose ~1e-3 at |x| = 1e4.
    tok_lp = tl.where(x_tok == float("-inf"), float("-inf"), (x_tok - shift) - log_sum)
    tl.store(tok_lp_ptr + pid, tok_lp)
    tl.store(tok_rank_ptr + pid, num_greater + 1)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < num_top
    kv = tl.load(top_vals_ptr + pid.to(tl.int64) * num_top + offs_k, mask=mask_k, other=0.0)
    top_lp = tl.where(kv == float("-inf"), float("-inf"), (kv - shift) - log_sum)
    tl.store(top_lp_ptr + pid.to(tl.int64) * num_top + offs_k, top_lp, mask=mask_k)


def compute_logprobs_triton(
    logits: Tensor,  # [N, V] float32 (bf16 / fp16 are read as is and upcast in the kernel)
    token_ids: Tensor,  # [N] int32 in [0, V)
    num_top: int,
) -> LogprobsTensors:
    """Triton version: torch.topk for the ids, then one kernel pass per row; no [N, V] log-softmax is built."""
    _check_inputs(logits, token_ids, num_top)
    num_rows, vocab_size = logits.shape
    top_vals, top_ids = _top_k(logits, num_top)  # [N, k] float32 (contiguous), [N, k] int32
    top_lp = torch.empty_like(top_vals)  # [N, k] float32
    tok_lp = torch.empty(num_rows, dtype=torch.float32, device=logits.device)  # [N] float32
    tok_rank = torch.empty(num_rows, dtype=torch.int32, device=logits.device)  # [N] int32
    if num_rows > 0:
        block_v = min(_BLOCK_V, triton.next_power_of_2(vocab_size))
        num_warps = max(4, min(16, block_v // 256))
        _logprobs_kernel[(num_rows,)](
            logits, logits.stride(0), logits.stride(1), token_ids.contiguous(), top_vals.contiguous(), top_lp,
            tok_lp, tok_rank, vocab_size, num_top, BLOCK_V=block_v,
            BLOCK_K=triton.next_power_of_2(max(num_top, 1)), num_warps=num_warps,
        )
    return LogprobsTensors(top_ids, top_lp, tok_lp, tok_rank)


def compute_logprobs(
    logits: Tensor,  # [N, V] float32 (bf16 / fp16 are upcast inside)
    token_ids: Tensor,  # [N] int32 in [0, V): the sampled token, or the actual next prompt token
    num_top: int,  # k in [0, MAX_NUM_TOP], a host int
    use_triton: bool,
) -> LogprobsTensors:
    """Top-k logprobs plus the token's logprob and rank per row. -inf logits get logprob -inf and outrank nothing."""
    fn = compute_logprobs_triton if use_triton else compute_logprobs_ref
    return fn(logits, token_ids, num_top)


# ---------------------------------------------------------------------------------------------------------------
# Prompt logprobs in chunks of positions.
# ---------------------------------------------------------------------------------------------------------------


def prompt_logprobs_chunked(
    hidden: Tensor,  # [P, H] hidden states of prompt positions (any float dtype)
    compute_logits: Callable[[Tensor], Tensor],  # [n, H] -> [n, V] float32 (bf16 / fp16 accepted)
    next_token_ids: Tensor,  # [P] int32, the prompt token that follows each position
    num_top: int,
    chunk_size: int,
    use_triton: bool,
) -> LogprobsTensors:
    """compute_logprobs over P positions, calling compute_logits on at most chunk_size rows at a time."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D, got shape {tuple(hidden.shape)}")
    _check(next_token_ids, "next_token_ids", (torch.int32,), 1, hidden.device)
    num_pos = hidden.shape[0]
    if next_token_ids.shape[0] != num_pos:
        raise ValueError(f"next_token_ids has {next_token_ids.shape[0]} entries, hidden has {num_pos} rows")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _check_num_top(num_top, None)
    dev = hidden.device
    out = LogprobsTensors(
        top_ids=torch.empty(num_pos, num_top, dtype=torch.int32, device=dev),  # [P, k] int32
        top_logprobs=torch.empty(num_pos, num_top, dtype=torch.float32, device=dev),  # [P, k] float32
        token_logprob=torch.empty(num_pos, dtype=torch.float32, device=dev),  # [P] float32
        token_rank=torch.empty(num_pos, dtype=torch.int32, device=dev),  # [P] int32
    )
    for start in range(0, num_pos, chunk_size):  # host ints only: P and chunk_size come from shapes / arguments
        end = min(start + chunk_size, num_pos)
        logits = compute_logits(hidden[start:end])  # [end - start, V]
        if logits.dim() != 2 or logits.shape[0] != end - start:
            raise ValueError(f"compute_logits returned shape {tuple(logits.shape)} for {end - start} rows")
        part = compute_logprobs(logits, next_token_ids[start:end], num_top, use_triton)
        out.top_ids[start:end] = part.top_ids
        out.top_logprobs[start:end] = part.top_logprobs
        out.token_logprob[start:end] = part.token_logprob
        out.token_rank[start:end] = part.token_rank
        del logits, part  # free this chunk's [n, V] logits before the next chunk's are computed
    return out
