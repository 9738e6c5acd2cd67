"""Gumbel-max sampling with a stateless counter-based RNG keyed by (seed, position, vocab index).

token = argmax(logits / T + g), g = -log(-log(u)), u from an integer hash implemented identically in PyTorch
(int64 lanes masked to 32 bits) and Triton (uint32); temperature 0 is an exact argmax. No softmax, no RNG state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check

_BLOCK_V = 4096  # vocab entries per loop iteration of one sampling program (1024 -> 4096 halved H200 latency)
_MASK32 = 0xFFFFFFFF
# Hash constants. _M1/_M2 are the multipliers of Chris Wellons' "lowbias32" finaliser; the others are arbitrary odd
# 32-bit constants (golden ratio, murmur3) that separate the seed key from the second per-row key.
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_SEED_SALT = 0x9E3779B9
_KEY2_SALT = 0x85EBCA6B
_U_SCALE = 2.0**-23  # u = ((h >> 9) + 0.5) * 2**-23 lies in [2**-24, 1 - 2**-24], every value exact in float32

# ---------------------------------------------------------------------------------------------------------------
# PyTorch reference of the hash: int64 tensors holding values in [0, 2**32); every product stays below 2**49.
# ---------------------------------------------------------------------------------------------------------------


def _mul32_ref(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), split so that no int64 product exceeds 2**48."""
    lo = c & 0xFFFF
    hi = c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32_ref(x: Tensor) -> Tensor:
    """lowbias32: a bijection on uint32 with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32_ref(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32_ref(x, _M2)
    return x ^ (x >> 16)


def _row_keys_ref(seeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Two 32-bit keys per (seed, position): all 64 bits of the seed and of the position are mixed in."""
    k = _mix32_ref((seeds & _MASK32) ^ _SEED_SALT)
    k = _mix32_ref(k ^ ((seeds >> 32) & _MASK32))
    k = _mix32_ref(k ^ (positions & _MASK32))
    k1 = _mix32_ref(k ^ ((positions >> 32) & _MASK32))
    k2 = _mix32_ref(k1 ^ _KEY2_SALT)
    return k1, k2


def _check_noise_args(seeds: Tensor, positions: Tensor, vocab_size: int) -> None:
    _check(seeds, "seeds", torch.int64, 1, seeds.device)
    _check(positions, "positions", torch.int64, 1, seeds.device)
    if positions.shape != seeds.shape:
        raise ValueError(f"positions shape {tuple(positions.shape)} != seeds shape {tuple(seeds.shape)}")
    if not isinstance(vocab_size, int) or vocab_size < 0:
        raise ValueError(f"vocab_size must be a non-negative int, got {vocab_size!r}")


def gumbel_noise_ref(
    seeds: Tensor,  # [B] int64
    positions: Tensor,  # [B] int64
    vocab_size: int,
) -> Tensor:  # [B, V] float32
    """Gumbel(0, 1) noise g[b, v] = -log(-log(u)), u = uniform(hash(seeds[b], positions[b], v))."""
    _check_noise_args(seeds, positions, vocab_size)
    k1, k2 = _row_keys_ref(seeds, positions)  # [B] int64 each
    idx = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V] int64
    h = _mix32_ref(_mix32_ref(idx[None, :] ^ k1[:, None]) ^ k2[:, None])  # [B, V] int64 in [0, 2**32)
    u = ((h >> 9).to(torch.float32) + 0.5) * _U_SCALE  # [B, V] float32 in (0, 1)
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------------------------------------------------------
# Triton version of the hash (uint32 arithmetic wraps modulo 2**32).
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D  # _M1
    x = x ^ (x >> 15)
    x = x * 0x846CA68B  # _M2
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seed, pos):
    # seed: int64 scalar, pos: int64 scalar
    k = _mix32(seed.to(tl.uint32) ^ 0x9E3779B9)  # _SEED_SALT
    k = _mix32(k ^ (seed >> 32).to(tl.uint32))
    k = _mix32(k ^ pos.to(tl.uint32))
    k1 = _mix32(k ^ (pos >> 32).to(tl.uint32))
    k2 = _mix32(k1 ^ 0x85EBCA6B)  # _KEY2_SALT
    return k1, k2


@triton.jit
def _gumbel(idx, k1, k2):
    # idx: int32 vocab indices; returns float32 Gumbel(0, 1) noise.
    h = _mix32(_mix32(idx.to(tl.uint32) ^ k1) ^ k2)
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_noise_kernel(
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64
    out_ptr,  # [B, V] float32
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k1, k2 = _row_keys(tl.load(seeds_ptr + pid), tl.load(positions_ptr + pid))
    tl.store(out_ptr + pid.to(tl.int64) * vocab_size + offs, _gumbel(offs, k1, k2), mask=offs < vocab_size)


@triton.jit
def _sample_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16
    stride_b,
    stride_v,
    idx_mapping_ptr,  # [B] int32
    temperature_ptr,  # [R] float32
    seeds_ptr,  # [R] int64
    num_tokens_ptr,  # [R] int32
    out_ptr,  # [B] int32
    vocab_size,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    k1, k2 = _row_keys(tl.load(seeds_ptr + row), tl.load(num_tokens_ptr + row).to(tl.int64))
    row_ptr = logits_ptr + pid.to(tl.int64) * stride_b
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < vocab_size
        x = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=m, other=float("-inf")).to(tl.float32)
        val = tl.where(greedy, x, x / temp + _gumbel(offs, k1, k2))
        val = tl.where(m, val, float("-inf"))
        blk_max = tl.max(val, axis=0)
        blk_idx = tl.argmax(val, axis=0).to(tl.int32) + v0
        better = blk_max > best_val  # strict: the earlier block keeps ties (lowest index wins)
        best_val = tl.where(better, blk_max, best_val)
        best_idx = tl.where(better, blk_idx, best_idx)
    tl.store(out_ptr + pid, best_idx)


# ---------------------------------------------------------------------------------------------------------------
# Launchers, references and the dispatcher.
# ---------------------------------------------------------------------------------------------------------------


def gumbel_noise_triton(
    seeds: Tensor,  # [B] int64
    positions: Tensor,  # [B] int64
    vocab_size: int,
) -> Tensor:  # [B, V] float32
    """Triton version of gumbel_noise_ref (used by tests to check the two hashes agree)."""
    _check_noise_args(seeds, positions, vocab_size)
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)  # [B, V] float32
    if out.numel() > 0:
        grid = (seeds.shape[0], triton.cdiv(vocab_size, _BLOCK_V))
        _gumbel_noise_kernel[grid](seeds.contiguous(), positions.contiguous(), out, vocab_size, BLOCK_V=_BLOCK_V)
    return out


def _check_sample(
    logits: Tensor, idx_mapping: Tensor, temperature: Tensor, seeds: Tensor, num_tokens: Tensor
) -> None:
    _check(logits, "logits", (torch.float32, torch.bfloat16, torch.float16), 2,
           logits.device)
    dev = logits.device
    _check(idx_mapping, "idx_mapping", torch.int32, 1, dev)
    _check(temperature, "temperature", torch.float32, 1, dev)
    _check(seeds, "seeds", torch.int64, 1, dev)
    _check(num_tokens, "num_tokens", torch.int32, 1, dev)
    if idx_mapping.shape[0] != logits.shape[0]:
        raise ValueError(f"idx_mapping has {idx_mapping.shape[0]} entries, logits has {logits.shape[0]} rows")
    if logits.shape[1] < 1:
        raise ValueError("logits must have a vocab dimension of at least 1")
    num_rows = temperature.shape[0]
    if seeds.shape[0] != num_rows or num_tokens.shape[0] != num_rows:
        raise ValueError(
            f"per-row tables differ in length: temperature {num_rows}, seeds {seeds.shape[0]}, "
            f"num_tokens {num_tokens.shape[0]}"
        )


def sample_ref(
    logits: Tensor,  # [B, V] float32 (bf16 / fp16 are upcast)
    idx_mapping: Tensor,  # [B] int32
    temperature: Tensor,  # [R] float32, 0 = greedy
    seeds: Tensor,  # [R] int64
    num_tokens: Tensor,  # [R] int32, RNG position key
) -> Tensor:  # [B] int32
    """PyTorch reference of sample; processes rows in chunks so the [chunk, V] noise stays small."""
    _check_sample(logits, idx_mapping, temperature, seeds, num_tokens)
    num_reqs, vocab_size = logits.shape
    rows = idx_mapping.long()  # [B] int64
    temp = temperature[rows]  # [B] float32
    greedy = temp == 0.0  # [B] bool
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    row_seeds = seeds[rows]  # [B] int64
    row_pos = num_tokens[rows].long()  # [B] int64
    out = torch.empty(num_reqs, dtype=torch.int32, device=logits.device)  # [B] int32
    chunk = max(1, (1 << 21) // vocab_size)
    for s in range(0, num_reqs, chunk):
        e = min(s + chunk, num_reqs)
        x = logits[s:e].float()  # [chunk, V] float32
        g = gumbel_noise_ref(row_seeds[s:e], row_pos[s:e], vocab_size)
        val = torch.where(greedy[s:e, None], x, x / temp[s:e, None] + g)
        out[s:e] = val.argmax(dim=-1).to(torch.int32)
    return out


def sample_rowwise_triton(
    logits: Tensor, idx_mapping: Tensor, temperature: Tensor, seeds: Tensor, num_tokens: Tensor
) -> Tensor:  # [B] int32
    """One program per row, looping over the vocab with a running (max, index)."""
    _check_sample(logits, idx_mapping, temperature, seeds, num_tokens)
    num_reqs, vocab_size = logits.shape
    out = torch.empty(num_reqs, dtype=torch.int32, device=logits.device)  # [B] int32
    if num_reqs == 0:
        return out
    block_v = min(_BLOCK_V, triton.next_power_of_2(vocab_size))
    num_warps = max(4, min(16, block_v // 256))  # 4096 x 16 warps: ~80 us per 152k-vocab row on an H200
    _sample_kernel[(num_reqs,)](
        logits, logits.stride(0), logits.stride(1), idx_mapping.contiguous(), temperature.contiguous(),
        seeds.contiguous(), num_tokens.contiguous(), out, vocab_size, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out
