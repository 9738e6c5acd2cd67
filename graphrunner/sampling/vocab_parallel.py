"""Gumbel-max sampling over a vocabulary split across tensor-parallel ranks, without gathering the logits.

The Gumbel noise is keyed by (seed, position, global vocab id), so each rank can take the max of
logits / T + noise over its own shard (`shard_sample`), and one all-gather of three numbers per row
(best value, its global id, a non-finite flag) lets every rank pick the same winner
(`combine_shard_picks`: the largest value, ties to the lowest id, as the single-device argmax does).
For the plain stage only (temperature / greedy): filters, penalties and logprobs need the whole row.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import num_sms as _num_sms
from graphrunner.kernel_checks import step_sizes
from graphrunner.parallel_state import tp_all_gather, tp_size
from graphrunner.sampling.gumbel import _check_sample, _gumbel, _row_keys, gumbel_noise_ref


def _check_shard(logits: Tensor, vocab_start: int, vocab_size: int, idx_mapping: Tensor, temperature: Tensor,
                 seeds: Tensor, num_tokens: Tensor) -> None:
    _check_sample(logits, idx_mapping, temperature, seeds, num_tokens)
    if not 0 <= vocab_start < vocab_size:
        raise ValueError(f"vocab_start {vocab_start} is not inside the vocabulary [0, {vocab_size})")


def shard_sample_ref(
    logits: Tensor,  # [B, S] this rank's vocabulary rows [vocab_start, vocab_start + S); ids >= vocab_size are padding
    vocab_start: int,
    vocab_size: int,
    idx_mapping: Tensor,  # [B] int32
    temperature: Tensor,  # [R] float32, 0 = greedy
    seeds: Tensor,  # [R] int64
    num_tokens: Tensor,  # [R] int32, RNG position key
) -> tuple[Tensor, Tensor]:  # best value [B] float32, its global id [B] int32
    """PyTorch reference of shard_sample: the shard's max of logits / T + noise(global id) (logits if greedy)."""
    _check_shard(logits, vocab_start, vocab_size, idx_mapping, temperature, seeds, num_tokens)
    valid = min(logits.shape[1], vocab_size - vocab_start)
    rows = idx_mapping.long()
    temp = temperature[rows]  # [B] float32
    greedy = temp == 0.0
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    x = logits[:, :valid].float()  # [B, valid]
    noise = gumbel_noise_ref(seeds[rows], num_tokens[rows].long(), vocab_start + valid)[:, vocab_start:]
    val = torch.where(greedy[:, None], x, x / temp[:, None] + noise)
    best, arg = val.max(dim=-1)  # first max on ties
    return best, (arg + vocab_start).to(torch.int32)


# GRAPHRUNNER_TP_SAMPLE=gather makes plain batches gather the logits too (to measure one against the other)
SHARD_SAMPLING_ENABLED: bool = os.environ.get("GRAPHRUNNER_TP_SAMPLE", "shard") != "gather"
_CHUNK_BLOCK = 1024  # vocab entries per loop iteration; chunks are multiples of it
_PROGRAMS_PER_SM = 4


@triton.jit(do_not_specialize=step_sizes("chunk", "num_chunks"))
def _shard_sample_kernel(
    logits_ptr,  # [B, S]
    stride_b,
    stride_v,
    idx_mapping_ptr,  # [B] int32
    temperature_ptr,  # [R] float32
    seeds_ptr,  # [R] int64
    num_tokens_ptr,  # [R] int32
    part_val_ptr,  # [B, C] float32: the chunk's best value
    part_idx_ptr,  # [B, C] int32: its global id (lowest on ties)
    vocab_start,
    valid,  # vocabulary entries of this shard (padding excluded)
    chunk,  # entries per program, a multiple of BLOCK_V
    num_chunks,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    k1, k2 = _row_keys(tl.load(seeds_ptr + row), tl.load(num_tokens_ptr + row).to(tl.int64))
    row_ptr = logits_ptr + pid.to(tl.int64) * stride_b
    start = c * chunk
    end = tl.minimum(start + chunk, valid)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = start
    for v0 in range(start, end, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < end
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=m, other=float("-inf")).to(tl.float32)
        val = tl.where(greedy, x, x / temp + _gumbel(offs + vocab_start, k1, k2))
        val = tl.where(m, val, float("-inf"))
        blk_max = tl.max(val, axis=0)
        blk_idx = tl.argmax(val, axis=0).to(tl.int32) + v0
        better = blk_max > best_val  # strict: the earlier block keeps ties (lowest index wins)
        best_val = tl.where(better, blk_max, best_val)
        best_idx = tl.where(better, blk_idx, best_idx)
    out = pid.to(tl.int64) * num_chunks + c
    tl.store(part_val_ptr + out, best_val)
    tl.store(part_idx_ptr + out, best_idx + vocab_start)



def shard_sample_triton(logits: Tensor, vocab_start: int, vocab_size: int, idx_mapping: Tensor, temperature: Tensor,
                        seeds: Tensor, num_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of shard_sample_ref: (row, chunk) programs write their best (value, id), and the row's
    first best chunk wins (chunks are in vocabulary order, so ties keep the lowest id)."""
    _check_shard(logits, vocab_start, vocab_size, idx_mapping, temperature, seeds, num_tokens)
    num_reqs = logits.shape[0]
    valid = min(logits.shape[1], vocab_size - vocab_start)
    if num_reqs == 0:
        return (torch.empty(0, dtype=torch.float32, device=logits.device),
                torch.empty(0, dtype=torch.int32, device=logits.device))
    blocks = triton.cdiv(valid, _CHUNK_BLOCK)
    want = max(1, triton.cdiv(_PROGRAMS_PER_SM * _num_sms(logits.device), num_reqs))
    chunk = triton.cdiv(blocks, min(blocks, want)) * _CHUNK_BLOCK
    num_chunks = triton.cdiv(valid, chunk)
    part_val = torch.empty(num_reqs, num_chunks, dtype=torch.float32, device=logits.device)  # [B, C]
    part_idx = torch.empty(num_reqs, num_chunks, dtype=torch.int32, device=logits.device)  # [B, C]
    _shard_sample_kernel[(num_reqs, num_chunks)](
        logits, logits.stride(0), logits.stride(1), idx_mapping.contiguous(), temperature.contiguous(),
        seeds.contiguous(), num_tokens.contiguous(), part_val, part_idx, vocab_start, valid, chunk, num_chunks,
        BLOCK_V=_CHUNK_BLOCK, num_warps=4,
    )
    winner = part_val.argmax(dim=1, keepdim=True)  # [B, 1]: first best chunk
    return part_val.gather(1, winner).squeeze(1), part_idx.gather(1, winner).squeeze(1)


def combine_shard_picks(picks: Tensor) -> tuple[Tensor, Tensor]:
    """picks [B, W, 3] float32 (per rank, in rank order: best value, global id, non-finite flag) ->
    (token [B] int32, nonfinite [B] bool): the largest value, on ties the lowest rank (so the lowest id)."""
    winner = picks[:, :, 0].argmax(dim=-1, keepdim=True)  # [B, 1]: first max
    token = picks[:, :, 1].gather(1, winner).squeeze(1).to(torch.int32)
    return token, picks[:, :, 2].amax(dim=-1) > 0


def sample_vocab_parallel(logits: Tensor, vocab_start: int, vocab_size: int, idx_mapping: Tensor,
                          temperature: Tensor, seeds: Tensor, num_tokens: Tensor,
                          use_triton: bool) -> tuple[Tensor, Tensor]:
    """The token every rank agrees on (and the row's non-finite flag) from this rank's logits shard [B, S];
    one all-gather of [B, 3] float32 (ids are exact in float32 below 2**24)."""
    fn = shard_sample_triton if use_triton else shard_sample_ref
    best, best_id = fn(logits, vocab_start, vocab_size, idx_mapping, temperature, seeds, num_tokens)
    valid = min(logits.shape[1], vocab_size - vocab_start)
    nonfinite = ~torch.isfinite(logits[:, :valid]).all(dim=-1)  # [B] bool
    mine = torch.stack([best, best_id.float(), nonfinite.float()], dim=-1)  # [B, 3]
    gathered = tp_all_gather(mine).view(mine.shape[0], tp_size(), 3)  # [B, W, 3]
    return combine_shard_picks(gathered)
