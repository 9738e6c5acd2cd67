"""Gumbel-max sampling with the vocabulary split across programs: each (row, vocab chunk) program writes its chunk's
(max, lowest argmax, any NaN/inf) partial and the row's last program to finish reduces them (or a second kernel),
so batch 1 keeps every SM busy. Tokens equal gumbel.py's row-per-program kernel (exact max, lowest index on ties);
the raw logits' non-finite check rides along. GRAPHRUNNER_SPLIT_SAMPLE picks the variant (below).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import num_sms as _num_sms
from graphrunner.kernel_checks import step_sizes, zeroed_counters
from graphrunner.sampling.gumbel import _check_sample, _gumbel, _row_keys, sample_ref, sample_rowwise_triton

# Read once at import, for A/B runs: GRAPHRUNNER_SPLIT_SAMPLE=0 row-per-program kernel, 1 (default) split with the
# last program of each row reducing (one launch), 2 split with a separate reduce kernel.
_MODE = os.environ.get("GRAPHRUNNER_SPLIT_SAMPLE", "1")
SPLIT_SAMPLE_ENABLED: bool = _MODE != "0"
SPLIT_SAMPLE_SERIAL: bool = _MODE != "2"
_BLOCK_V = 1024  # vocab entries per loop iteration; also the smallest chunk one program owns
_PROGRAMS_PER_SM = 4  # aim for this many (row, chunk) programs per SM before chunks grow past _BLOCK_V
_MAX_CHUNKS = 1024  # the reduce kernel reads a row's partials in one block of at most this many
_MAX_ROWS = 1 << 16  # rows with a counter for the one-launch reduction (more: the reduce kernel)


@triton.jit
def _reduce_row(part_val_ptr, part_idx_ptr, part_bad_ptr, out_ptr, nonfinite_ptr, pid, num_chunks,
                C_PAD: tl.constexpr, CACHE: tl.constexpr):
    offs = tl.arange(0, C_PAD)
    m = offs < num_chunks
    base = pid.to(tl.int64) * num_chunks
    vals = tl.load(part_val_ptr + base + offs, mask=m, other=float("-inf"), cache_modifier=CACHE)
    idxs = tl.load(part_idx_ptr + base + offs, mask=m, other=0, cache_modifier=CACHE)
    bad = tl.load(part_bad_ptr + base + offs, mask=m, other=0, cache_modifier=CACHE)
    best = tl.argmax(vals, axis=0)  # lowest chunk on ties, and chunks are in vocab order: lowest index overall
    tl.store(out_ptr + pid, tl.sum(tl.where(offs == best, idxs, 0), axis=0))
    tl.store(nonfinite_ptr + pid, tl.max(bad, axis=0) > 0)


@triton.jit(do_not_specialize=step_sizes("chunk", "num_chunks"))
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
    counter_ptr,  # [>= B] int32, zero between launches (SERIAL)
    out_ptr,  # [B] int32 (SERIAL)
    nonfinite_ptr,  # [B] bool (SERIAL)
    vocab_size,
    chunk,  # vocab entries per program, a multiple of BLOCK_V
    num_chunks,
    BLOCK_V: tl.constexpr,
    C_PAD: tl.constexpr,
    SERIAL: tl.constexpr,  # the row's last program to finish reduces its partials (an atomic counter says which)
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
    if SERIAL:
        tl.debug_barrier()  # the partials are stored before the release below publishes them
        done = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == num_chunks - 1:
            _reduce_row(part_val_ptr, part_idx_ptr, part_bad_ptr, out_ptr, nonfinite_ptr, pid, num_chunks,
                        C_PAD, ".cg")  # from L2: other SMs wrote them
            tl.atomic_xchg(counter_ptr + pid, 0)  # zero again for the next launch (and graph replay)


@triton.jit(do_not_specialize=step_sizes("num_chunks"))
def _split_sample_reduce_kernel(
    part_val_ptr,  # [B, C] float32
    part_idx_ptr,  # [B, C] int32
    part_bad_ptr,  # [B, C] int32
    out_ptr,  # [B] int32
    nonfinite_ptr,  # [B] bool
    num_chunks,
    C_PAD: tl.constexpr,
):
    _reduce_row(part_val_ptr, part_idx_ptr, part_bad_ptr, out_ptr, nonfinite_ptr, tl.program_id(0), num_chunks,
                C_PAD, "")


_counters: dict[torch.device, Tensor] = {}
_zero_tables: dict[torch.device, Tensor] = {}


def _counter_buffer(device: torch.device) -> Tensor | None:
    """The one-launch reduction's per-row counters ([_MAX_ROWS] int32 per device; kernel_checks.zeroed_counters)."""
    return zeroed_counters(_counters, device, _MAX_ROWS)



def chunk_pad(vocab_size: int) -> int:
    """C_PAD of the kernels that reduce a row's chunk partials: the most chunks split_plan can give this vocabulary,
    padded, so one compiled variant serves every batch size (a per-call value compiled new variants mid-run)."""
    return max(16, triton.next_power_of_2(min(triton.cdiv(vocab_size, _BLOCK_V), _MAX_CHUNKS)))


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
    """gumbel_split.sample with the vocab split across programs; also returns ~isfinite(logits).all(-1)."""
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
    c_pad = chunk_pad(vocab_size)
    counters = _counter_buffer(logits.device) if SPLIT_SAMPLE_SERIAL and num_reqs <= _MAX_ROWS else None
    _split_sample_partial_kernel[(num_reqs, num_chunks)](
        logits, logits.stride(0), logits.stride(1), idx_mapping.contiguous(), temperature.contiguous(),
        seeds.contiguous(), num_tokens.contiguous(), part_val, part_idx, part_bad,
        counters if counters is not None else part_idx, out, nonfinite, vocab_size, chunk, num_chunks,
        BLOCK_V=_BLOCK_V, C_PAD=c_pad, SERIAL=counters is not None, num_warps=4,
    )
    if counters is None:
        _split_sample_reduce_kernel[(num_reqs,)](part_val, part_idx, part_bad, out, nonfinite, num_chunks,
                                                 C_PAD=c_pad, num_warps=1)
    return out, nonfinite


def sample_split_ref(
    logits: Tensor, idx_mapping: Tensor, temperature: Tensor, seeds: Tensor, num_tokens: Tensor
) -> tuple[Tensor, Tensor]:  # [B] int32, [B] bool
    """PyTorch reference of sample_split_triton: gumbel.sample_ref plus the non-finite flag of each row."""
    return sample_ref(logits, idx_mapping, temperature, seeds, num_tokens), ~torch.isfinite(logits).all(dim=-1)


def sample_triton(
    logits: Tensor, idx_mapping: Tensor, temperature: Tensor, seeds: Tensor, num_tokens: Tensor
) -> Tensor:  # [B] int32
    """Triton version of sample: the vocab split across programs (below) unless
    GRAPHRUNNER_SPLIT_SAMPLE=0, then one program per row."""
    if SPLIT_SAMPLE_ENABLED:
        return sample_split_triton(logits, idx_mapping, temperature, seeds, num_tokens)[0]
    return sample_rowwise_triton(logits, idx_mapping, temperature, seeds, num_tokens)


def greedy_argmax(logits: Tensor, use_triton: bool) -> Tensor:  # [B] int32 (split kernel) / int64 (torch)
    """Exact argmax of each row of logits [B, V] in any float dtype, lowest index on ties: the split sampler at
    temperature 0 where Triton runs (one launch straight from model-dtype logits, where a float32 copy and
    torch.argmax took two and ~7.5 µs at a 4K vocabulary), torch.argmax otherwise and while a CUDA graph is being
    captured before the kernel's zero tables exist. Rows holding NaN differ: the kernel never picks a NaN."""
    b = logits.shape[0]
    zeros = zeroed_counters(_zero_tables, logits.device, _MAX_ROWS) if use_triton and 0 < b <= _MAX_ROWS else None
    if zeros is None or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    # every logits row reads state row 0 of one-entry tables of zeros (never written): temperature 0.0 (an int32
    # 0 read as float32), seed 0, position 0
    return sample_split_triton(logits, zeros[:b], zeros[:1].view(torch.float32), zeros[:2].view(torch.int64),
                               zeros[:1])[0]


def sample(
    logits: Tensor,  # [B, V] float32 (bf16 / fp16 are upcast inside)
    idx_mapping: Tensor,  # [B] int32
    temperature: Tensor,  # [R] float32 per row; 0 = greedy (exact argmax, lowest index on ties)
    seeds: Tensor,  # [R] int64 per row
    num_tokens: Tensor,  # [R] int32 per row; the RNG position key is num_tokens[row]
    use_triton: bool,
) -> Tensor:  # [B] int32
    """Gumbel-max sample one token per row; same (seed, position) gives the same token whatever the batch."""
    fn = sample_triton if use_triton else sample_ref
    return fn(logits, idx_mapping, temperature, seeds, num_tokens)
