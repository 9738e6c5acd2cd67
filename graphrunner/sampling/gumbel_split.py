"""Gumbel-max sampling with the vocabulary split across programs: one program per (row, vocab chunk) writes its
chunk's (max, argmax, any-non-finite) partial, a second tiny kernel reduces each row. Same tokens as gumbel.py's
one-program-per-row kernel (max is exact, ties keep the lowest index whatever the split), but batch 1 keeps every
SM busy. The non-finite check of the raw logits rides along in the same pass. Switch: GRAPHRUNNER_SPLIT_SAMPLE=0.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.sampling.gumbel import _check_sample, _gumbel, _row_keys, sample_ref

# Read once at import: the lead A/B-tests the split kernel against the row-per-program one with this variable.
SPLIT_SAMPLE_ENABLED: bool = os.environ.get("GRAPHRUNNER_SPLIT_SAMPLE", "1") != "0"
_BLOCK_V = 1024  # vocab entries per loop iteration; also the smallest chunk one program owns
_PROGRAMS_PER_SM = 4  # aim for this many (row, chunk) programs per SM before chunks grow past _BLOCK_V
_MAX_CHUNKS = 1024  # the reduce kernel reads a row's partials in one block of at most this many


@triton.jit
def _split_sample_partial_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16
    stride_b,
    stride_v,
    idx_mapping_ptr,  # [B] int32
    temperature_ptr,  # [R] float32
    seeds_ptr,  # [R] int64
    num_tokens_ptr,  # [R] int32
    part_val_ptr,  # [B, C] float32: the chunk's best value (NaN counted as -inf)
    part_idx_ptr,  # [B, C] int32: the lowest vocab index holding that value
    part_bad_ptr,  # [B, C] int32: 1 when the chunk's raw logits hold NaN or +-inf
    vocab_size,
    chunk,  # vocab entries per program, a multiple of BLOCK_V
    num_chunks,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0
    k1, k2 = _row_keys(tl.load(seeds_ptr + row), tl.load(num_tokens_ptr + row).to(tl.int64))
    row_ptr = logits_ptr + pid.to(tl.int64) * stride_b
    start = c * chunk
    end = tl.minimum(start + chunk, vocab_size)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = start  # every chunk is non-empty, so `start` is a valid token even when the chunk is all -inf/NaN
    bad = tl.full((), 0, tl.int32)
    for v0 in range(start, end, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < end
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=m, other=0.0).to(tl.float32)
        bad = tl.maximum(bad, tl.max((~(tl.abs(x) < float("inf"))).to(tl.int32), axis=0))  # NaN or +-inf
        if greedy:
            val = x
        else:
            val = x / temp + _gumbel(offs, k1, k2)
        val = tl.where(m & (tl.abs(val) <= float("inf")), val, float("-inf"))  # NaN never wins
        blk_max = tl.max(val, axis=0)
        blk_idx = tl.argmax(val, axis=0).to(tl.int32) + v0
        better = blk_max > best_val  # strict: the earlier block keeps ties (lowest index wins)
        best_val = tl.where(better, blk_max, best_val)
        best_idx = tl.where(better, blk_idx, best_idx)
    out = pid.to(tl.int64) * num_chunks + c
    tl.store(part_val_ptr + out, best_val)
    tl.store(part_idx_ptr + out, best_idx)
    tl.store(part_bad_ptr + out, bad)


@triton.jit
def _split_sample_reduce_kernel(
    part_val_ptr,  # [B, C] float32
    part_idx_ptr,  # [B, C] int32
    part_bad_ptr,  # [B, C] int32
    out_ptr,  # [B] int32
    nonfinite_ptr,  # [B] bool
    num_chunks,
    C_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.arange(0, C_PAD)
    m = offs < num_chunks
    base = pid.to(tl.int64) * num_chunks
    vals = tl.load(part_val_ptr + base + offs, mask=m, other=float("-inf"))
    idxs = tl.load(part_idx_ptr + base + offs, mask=m, other=0)
    bad = tl.load(part_bad_ptr + base + offs, mask=m, other=0)
    best = tl.argmax(vals, axis=0)  # lowest chunk on ties, and chunks are in vocab order: lowest index overall
    tl.store(out_ptr + pid, tl.sum(tl.where(offs == best, idxs, 0), axis=0))
    tl.store(nonfinite_ptr + pid, tl.max(bad, axis=0) > 0)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few chunks per row, so tests cover the reduction
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_plan(num_reqs: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(chunk, num_chunks): chunks of a multiple of _BLOCK_V entries, about _PROGRAMS_PER_SM programs per SM."""
    max_chunks = min(triton.cdiv(vocab_size, _BLOCK_V), _MAX_CHUNKS)
    want = max(1, min(max_chunks, triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), max(num_reqs, 1))))
    chunk = triton.cdiv(triton.cdiv(vocab_size, want), _BLOCK_V) * _BLOCK_V
    return chunk, triton.cdiv(vocab_size, chunk)


def sample_split_triton(
    logits: Tensor,  # [B, V] float32 / bfloat16 / float16
    idx_mapping: Tensor,  # [B] int32
    temperature: Tensor,  # [R] float32, 0 = greedy
    seeds: Tensor,  # [R] int64
    num_tokens: Tensor,  # [R] int32, RNG position key
) -> tuple[Tensor, Tensor]:  # [B] int32 tokens, [B] bool: the row's logits held NaN or +-inf
    """gumbel.sample with the vocab split across programs; also returns ~isfinite(logits).all(-1)."""
    _check_sample(logits, idx_mapping, temperature, seeds, num_tokens)
    num_reqs, vocab_size = logits.shape
    out = torch.empty(num_reqs, dtype=torch.int32, device=logits.device)  # [B] int32
    nonfinite = torch.empty(num_reqs, dtype=torch.bool, device=logits.device)  # [B] bool
    if num_reqs == 0:
        return out, nonfinite
    chunk, num_chunks = split_plan(num_reqs, vocab_size, logits.device)
    part_val = torch.empty(num_reqs, num_chunks, dtype=torch.float32, device=logits.device)  # [B, C] float32
    part_idx = torch.empty(num_reqs, num_chunks, dtype=torch.int32, device=logits.device)  # [B, C] int32
    part_bad = torch.empty(num_reqs, num_chunks, dtype=torch.int32, device=logits.device)  # [B, C] int32
    _split_sample_partial_kernel[(num_reqs, num_chunks)](
        logits, logits.stride(0), logits.stride(1), idx_mapping.contiguous(), temperature.contiguous(),
        seeds.contiguous(), num_tokens.contiguous(), part_val, part_idx, part_bad, vocab_size, chunk, num_chunks,
        BLOCK_V=_BLOCK_V, num_warps=4,
    )
    _split_sample_reduce_kernel[(num_reqs,)](part_val, part_idx, part_bad, out, nonfinite, num_chunks,
                                             C_PAD=max(16, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out, nonfinite


def sample_split_ref(
    logits: Tensor, idx_mapping: Tensor, temperature: Tensor, seeds: Tensor, num_tokens: Tensor
) -> tuple[Tensor, Tensor]:  # [B] int32, [B] bool
    """PyTorch reference of sample_split_triton: gumbel.sample_ref plus the non-finite flag of each row."""
    return sample_ref(logits, idx_mapping, temperature, seeds, num_tokens), ~torch.isfinite(logits).all(dim=-1)
