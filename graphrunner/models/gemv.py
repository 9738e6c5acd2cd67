"""Small-M linear for decode: y = x @ W^T (+ b) with x [M <= 8, K] and W [N, K] in bf16/fp16, reading W once.

Programs tile N (and split K when N alone leaves SMs idle); a split-K run writes float32 partials that a second
kernel sums in a fixed order (no atomics, so graphs == eager bit for bit). Exposed as the torch custom op
`graphrunner::small_m_linear`, which falls back to F.linear for larger M, so torch.compile sees one opaque call.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor
from graphrunner.kernel_checks import num_sms as _num_sms

MAX_M = 8  # token counts above this go to cuBLAS
_DTYPES = (torch.bfloat16, torch.float16)
# Tuned launch shapes written by `tools/bench_kernels.py --sweep --tuned-out FILE`; $GRAPHRUNNER_GEMV_CONFIGS
# names another file. Shapes missing from it use default_config's heuristic.
TUNED_CONFIGS_FILE = Path(__file__).with_name("gemv_configs.json")


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of one small-M linear; bench_kernels.py sweeps these."""

    block_n: int  # output features per program
    block_k: int  # K elements per loop iteration (8 bf16 = one 128-bit load per thread and row)
    split_k: int  # programs sharing one N tile, each over K / split_k
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True  # tl.dot on x padded to 16 rows (tensor cores) vs a broadcast-multiply-reduce
    # split-K only: the last program of each N tile (an atomic counter says which) sums the partials itself,
    # instead of a second kernel launch; same order, same bits
    serial_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


def load_tuned_configs(path: Path | str) -> dict[tuple[int, int, int], GemvConfig | None]:
    """{(M, N, K): config, or None where cuBLAS won} from a JSON list of {"M", "N", "K", "config"}."""
    try:
        entries = json.loads(Path(path).read_text())
        return {(int(e["M"]), int(e["N"]), int(e["K"])): None if e["config"] is None else GemvConfig(**e["config"])
                for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad GEMV config file {path}: {exc}") from exc


@functools.cache
def tuned_configs() -> dict[tuple[int, int, int], GemvConfig | None]:
    path = os.environ.get("GRAPHRUNNER_GEMV_CONFIGS") or (TUNED_CONFIGS_FILE if TUNED_CONFIGS_FILE.exists() else None)
    return load_tuned_configs(path) if path else {}


def pick_config(m: int, n: int, k: int, device: torch.device,
                tuned: dict[tuple[int, int, int], GemvConfig | None] | None = None) -> GemvConfig | None:
    """The tuned entry of the smallest tuned M >= m for this (N, K) on CUDA (None: cuBLAS is faster there), else
    default_config's heuristic."""
    table = tuned if tuned is not None else tuned_configs() if device.type == "cuda" else {}
    for mm in range(m, MAX_M + 1):
        if (mm, n, k) in table:
            return table[(mm, n, k)]
    return default_config(m, n, k, device)



def default_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """Heuristic: enough programs for every SM a few times over, each streaming >= 2 blocks of K per W row."""
    sms = _num_sms(device)
    block_n = 64 if n >= 64 * 4 * sms else 32 if n >= 32 * 2 * sms else 16
    block_k = 256 if k >= 256 else max(16, triton.next_power_of_2(k))
    if m == 1:  # the broadcast-multiply-reduce path holds a [BN, BK] float32 product in registers
        block_k = min(block_k, 128)
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < 2 * sms and k // (split_k * 2) >= 2 * block_k:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k, num_warps=4, use_dot=m > 1, serial_reduce=True)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] bf16/fp16, unit stride along K
    w_ptr,  # [N, K] bf16/fp16, unit stride along K
    b_ptr,  # [N] or unused
    out_ptr,  # [M, N] (not WRITE_PARTIAL)
    part_ptr,  # [split_k, M, N] float32 (WRITE_PARTIAL)
    counter_ptr,  # [>= N tiles] int32, zero between launches (SERIAL_REDUCE)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    num_splits,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-K: float32 partials for _split_k_reduce_kernel (not a split count, so
    HAS_BIAS: tl.constexpr,  # one compiled kernel serves every split)
    USE_DOT: tl.constexpr,
    SERIAL_REDUCE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [M_PAD, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [M_PAD, BK]
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    mask = m_mask[:, None] & n_mask[None, :]
    if not WRITE_PARTIAL:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)
        if SERIAL_REDUCE:
            tl.debug_barrier()  # every thread's partial is stored before the release below publishes them
            done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:  # the last split of this tile: sum all partials, as the reduce kernel does
                total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
                for s in range(num_splits):
                    src = part_ptr + (s * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
                    total += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")  # L2: other SMs wrote it
                if HAS_BIAS:
                    total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
                tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter_ptr + pid_n, 0)  # zero again for the next launch (and graph replay)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # [SPLIT_K, M, N] float32
    b_ptr,  # [N] or unused
    out_ptr,  # [M, N]
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits every run
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


_MAX_TILES = 16384
_counters: dict[torch.device, Tensor] = {}


def _counter_buffer(device: torch.device) -> Tensor | None:
    """The zeroed per-tile counters of the serial split-K reduction ([_MAX_TILES] int32, one per device, reset by
    the kernel itself); None while a CUDA graph is being captured and none exists yet (never allocate there)."""
    buf = _counters.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = _counters[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return buf


def _check(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    check_tensor(x, "x", _DTYPES, 2, None)
    check_tensor(weight, "weight", x.dtype, 2, x.device)
    if bias is not None:
        check_tensor(bias, "bias", x.dtype, 1, x.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} entries, weight has {weight.shape[0]} rows")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, {x.shape[1]}] and weight [N, {weight.shape[1]}] disagree on K")
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv_triton takes at most {MAX_M} rows, got {x.shape[0]}")


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # [M, N]
    """PyTorch reference: float32 accumulation of x [M, K] @ weight [N, K]^T (+ bias), cast to x's dtype."""
    _check(x, weight, bias)
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig | None = None) -> Tensor:
    """x [M <= 8, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 accumulation."""
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    cfg = config or pick_config(m, n, k, x.device) or default_config(m, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)  # never an empty split
    m_pad = 16 if cfg.use_dot else max(1, triton.next_power_of_2(m))
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    bias_arg = bias if bias is not None else out  # unused when HAS_BIAS is off
    tiles = triton.cdiv(n, cfg.block_n)
    counters = _counter_buffer(x.device) if cfg.serial_reduce and split_k > 1 and tiles <= _MAX_TILES else None
    _gemv_kernel[(tiles, split_k)](
        x, weight, bias_arg, out, part, counters if counters is not None else out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), k_per_split, split_k, M_PAD=m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        WRITE_PARTIAL=split_k > 1, HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot, SERIAL_REDUCE=counters is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split_k > 1 and counters is None:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            part, bias_arg, out, m, n, out.stride(0), SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block,
            num_warps=4,
        )
    return out


@torch.library.custom_op("graphrunner::small_m_linear", mutates_args=())
def small_m_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] -> [M, N]: the Triton GEMV when M <= MAX_M (decided at run time, so one traced graph serves
    every token count), else F.linear (cuBLAS), as it is where the tuned table says cuBLAS wins."""
    if x.shape[0] > MAX_M or x.dtype not in _DTYPES:
        return F.linear(x, weight, bias)
    config = pick_config(x.shape[0], weight.shape[0], x.shape[1], x.device)
    return F.linear(x, weight, bias) if config is None else gemv_triton(x, weight, bias, config)


@small_m_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
