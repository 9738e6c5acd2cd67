"""Small-M linear for decode: y = x @ W^T (+ b) with x [M <= 8, K] and W [N, K] in bf16/fp16, reading W once.

Each program loads a [BLOCK_N, BLOCK_K] tile of W per step along K and applies it to every row of x in turn (or,
for larger M, to x padded to 16 rows in one tl.dot, either operand first), so a row's bits never depend on M: a
padded CUDA graph and an eager step agree. Split-K partials are summed in split order by the last program of each
N tile. `linear()` routes the shapes tuned in gemv_configs.json to it, and at one or two tokens the shapes the table
does not list (default_config's row loop, where it beat cuBLAS on the H200).
"""

from __future__ import annotations

import dataclasses
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

from graphrunner.env import env_choice
from graphrunner.kernel_checks import check_tensor, zeroed_counters
from graphrunner.kernel_checks import num_sms as _num_sms
from graphrunner.models.activation import silu_mul, silu_mul_ref, silu_mul_triton
from graphrunner.models.norm import normed_tile, rms_norm_any
from graphrunner.opaque import opaque_op
from graphrunner.pdl import pdl_enter, pdl_mode, use_pdl

MAX_M = 8  # token counts above this go to cuBLAS
_DTYPES = (torch.bfloat16, torch.float16)
# Per-(N, K) launch shapes measured on the H200 by `tools/bench_kernels.py --sweep --tuned-out FILE`;
# $GRAPHRUNNER_GEMV_CONFIGS names another file, GRAPHRUNNER_GEMV=0 turns the routing off (cuBLAS everywhere).
TUNED_CONFIGS_FILE = Path(__file__).with_name("gemv_configs.json")
ENABLED = env_choice("GRAPHRUNNER_GEMV", ("0", "1"), "1") == "1"
# GRAPHRUNNER_GEMV_NORM=1: an RMSNorm feeding a routed linear runs in the GEMV's prologue (models.linear.norm_linear);
# off until measured on the H200 (docs/DECISIONS.md)
NORM_PROLOGUE = env_choice("GRAPHRUNNER_GEMV_NORM", ("0", "1"), "0") == "1"
# GRAPHRUNNER_GEMV_ACT=1: the MLP's silu(gate) * up runs in the down projection's GEMV prologue
# (models.linear.silu_mul_linear); on by default, measured on the H200 (docs/DECISIONS.md)
ACT_PROLOGUE = env_choice("GRAPHRUNNER_GEMV_ACT", ("0", "1"), "1") == "1"
# GRAPHRUNNER_GEMV_UNTUNED=0: a weight shape without an entry in the table goes to cuBLAS at every token count; by
# default default_config's row loop serves it where it beat cuBLAS on the H200 over 27 shapes of 0.3B-8B models
# (docs/BENCHMARKS.md, twenty-sixth session): one token where K <= UNTUNED_MAX_K, two where the weight is also at
# most UNTUNED_M2_MAX_WEIGHT elements
UNTUNED = env_choice("GRAPHRUNNER_GEMV_UNTUNED", ("0", "1"), "1") == "1"
UNTUNED_MAX_K = 8192  # longer rows (the 4B-8B down projections): cuBLAS was 8-15% faster at M = 1
UNTUNED_M2_MAX_WEIGHT = 4096 * 2048  # larger weights: cuBLAS was up to 27% faster at M = 2
# GRAPHRUNNER_GEMV_PREFETCH=1: with PDL, each program asks L2 for its whole weight slice before waiting for the kernel
# before it, so the weights stream while that kernel finishes (the row loop's first-tile load, for every config)
PREFETCH = env_choice("GRAPHRUNNER_GEMV_PREFETCH", ("0", "1"), "0") == "1"


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of one (N, K); the same for every M, which is what keeps rows batch-invariant."""

    block_n: int  # output features per program
    block_k: int  # K elements per loop step (8 bf16 per thread and row = one 128-bit load)
    split_k: int = 1  # programs sharing one N tile, each over K / split_k
    num_warps: int = 4
    num_stages: int = 1
    max_m: int = MAX_M  # token counts up to this (a power of two: a padded size never crosses it) use the kernel
    # tensor cores: x padded to 16 rows, one tl.dot per weight tile (rows still independent of M, since the
    # instruction shape and the K order are fixed); for the counts past a row-loop config's max_m
    use_dot: bool = False
    # with use_dot: the weight tile is the MMA's A operand (out^T [BLOCK_N, 16] = W x^T), the usual small-M
    # ("swap AB") orientation: the 16-row minimum of the instruction falls on N, and x's 16 padded rows are its
    # narrow operand
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 1 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 1, got {self.block_n}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.max_m not in (1, 2, 4, 8):
            raise ValueError(f"max_m must be 1, 2, 4 or 8, got {self.max_m}")
        if self.use_dot and self.block_n < 16:
            raise ValueError(f"a tl.dot config needs block_n >= 16, got {self.block_n}")
        if self.swap_ab and not self.use_dot:
            raise ValueError("swap_ab is an orientation of the tensor-core path: it needs use_dot")


def load_tuned_configs(path: Path | str) -> dict[tuple[int, int], tuple[GemvConfig, ...]]:
    """{(N, K): its configs by ascending max_m, empty where cuBLAS won} from a JSON list of {"N", "K", "configs":
    [...]} (or the older single "config", null for cuBLAS)."""
    try:
        table = {}
        for e in json.loads(Path(path).read_text()):
            raw = e["configs"] if "configs" in e else [] if e["config"] is None else [e["config"]]
            configs = tuple(sorted((GemvConfig(**c) for c in raw), key=lambda c: c.max_m))
            if len({c.max_m for c in configs}) != len(configs):
                raise ValueError(f"two configs of ({e['N']}, {e['K']}) share a max_m")
            table[(int(e["N"]), int(e["K"]))] = configs
        return table
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad GEMV config file {path}: {exc}") from exc


@functools.cache
def tuned_configs() -> dict[tuple[int, int], tuple[GemvConfig, ...]]:
    path = os.environ.get("GRAPHRUNNER_GEMV_CONFIGS") or (TUNED_CONFIGS_FILE if TUNED_CONFIGS_FILE.exists() else None)
    return load_tuned_configs(path) if path else {}


def config_for(m: int, n: int, k: int, device: torch.device | None = None) -> GemvConfig | None:
    """The config serving M tokens of W [N, K] on `device` (default: the current CUDA device): the tuned table's
    first (smallest max_m) whose max_m >= M; for a shape the table does not list, untuned_config up to
    untuned_max_m tokens (GRAPHRUNNER_GEMV_UNTUNED). None: cuBLAS."""
    configs = tuned_configs().get((n, k))
    if configs is None:
        return untuned_config(n, k, device) if UNTUNED and m <= untuned_max_m(n, k) else None
    return next((c for c in configs if m <= c.max_m), None)


def untuned_max_m(n: int, k: int) -> int:
    """The token counts default_config's row loop serves for W [N, K] without a table entry (0: none)."""
    if k > UNTUNED_MAX_K:
        return 0
    return 2 if n * k <= UNTUNED_M2_MAX_WEIGHT else 1


def untuned_config(n: int, k: int, device: torch.device | None = None) -> GemvConfig:
    """default_config's row loop for up to untuned_max_m tokens of a shape without a table entry (at least one)."""
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    return _untuned_config(n, k, _num_sms(dev))


@functools.cache  # (eager steps ask per call)
def _untuned_config(n: int, k: int, sms: int) -> GemvConfig:
    return dataclasses.replace(_heuristic_config(n, k, sms), max_m=max(1, untuned_max_m(n, k)))


@functools.cache
def _heuristic_config(n: int, k: int, sms: int) -> GemvConfig:
    block_k = max(16, min(1024, triton.next_power_of_2(k)))
    block_n = max(1, min(16, 8192 // block_k))
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < 2 * sms and k // (split_k * 2) >= block_k:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k)


def is_tuned(n: int, k: int) -> bool:
    """Whether W [N, K] has a tuned GEMV config. Dynamo calls this at trace time and keeps the answer as a
    constant (tracing into it would trace the table's file read)."""
    return bool(tuned_configs().get((n, k)))


def serves(n: int, k: int) -> bool:
    """Whether the small-M op serves W [N, K] at some token count: a tuned config, or no table entry at all with
    GRAPHRUNNER_GEMV_UNTUNED on (an entry without configs is a shape where cuBLAS won at every M). A constant at
    trace time, as is_tuned."""
    configs = tuned_configs().get((n, k))
    return bool(configs) if configs is not None else UNTUNED and untuned_max_m(n, k) > 0


# What torch.compiler.assume_constant_result does, without importing Dynamo (2-3 s) into an engine that never
# compiles: it sets this attribute, which Dynamo reads at trace time (tests/test_gemv.py holds torch to it)
is_tuned._dynamo_marked_constant = True  # type: ignore[attr-defined]
serves._dynamo_marked_constant = True  # type: ignore[attr-defined]


def routes_to_gemv(weight: Tensor) -> bool:
    """Whether `linear()` sends this weight to the small-M op: a CUDA bf16/fp16 [N, K] weight the op serves
    (`serves`), unless GRAPHRUNNER_GEMV=0. Decided from metadata only, at trace time."""
    if not ENABLED or weight.device.type != "cuda" or weight.dtype not in _DTYPES or weight.dim() != 2:
        return False
    return serves(int(weight.shape[0]), int(weight.shape[1]))


def default_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """Heuristic for untuned calls: full-K tiles of ~8K weights, split K only while N leaves SMs idle."""
    return _heuristic_config(n, k, _num_sms(device))


@triton.jit
def _gemv_step(acc, w, k0, k_end, K, x_ptr, x_rows, norm_ptr, inv, M, stride_xm, rows, M_PAD: tl.constexpr,
               BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
               SWAP_AB: tl.constexpr):
    """acc [M_PAD, BLOCK_N] += x[:, k0:k0 + BLOCK_K] (normalised with NORM; with ACT, silu(x[:, k]) * x[:, K + k])
    @ w^T for the loaded tile w [BN, BK]; with SWAP_AB, acc [BLOCK_N, M_PAD] += w @ x^T."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_end
    if NORM:
        norm_w = tl.load(norm_ptr + offs_k, mask=k_mask, other=0.0)  # [BK]
    else:
        norm_w = offs_k  # unused
    if USE_DOT:  # M_PAD is always 16 here: one instruction shape whatever M
        x = tl.load(x_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)  # [16, BK]
        if NORM:
            x = normed_tile(x, inv[:, None], norm_w[None, :])
        if ACT:
            x = silu_mul(x, tl.load(x_rows + K + offs_k[None, :], mask=k_mask[None, :], other=0.0))
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    else:
        wf = w.to(tl.float32)
        # One x row at a time through the same [BLOCK_N, BLOCK_K] reduction: row m's sums do not see M_PAD.
        for m in tl.static_range(M_PAD):
            xm = tl.load(x_ptr + tl.minimum(M - 1, m) * stride_xm + offs_k, mask=k_mask, other=0.0)  # [BK]
            if NORM:
                xm = normed_tile(xm, tl.sum(tl.where(rows == m, inv, 0.0), axis=0), norm_w)
            if ACT:
                xm = silu_mul(xm, tl.load(x_ptr + tl.minimum(M - 1, m) * stride_xm + K + offs_k, mask=k_mask,
                                          other=0.0))
            part = tl.sum(wf * xm.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    return acc


def prefetch_on(pdl: bool, block_k: int) -> bool:
    """The PREFETCH constexpr of a launch: GRAPHRUNNER_GEMV_PREFETCH, with PDL, and K steps of whole lines."""
    return pdl and PREFETCH and block_k >= 64


@triton.jit
def prefetch_l2(w_pf, k_start, k_end, BLOCK_K: tl.constexpr):
    """Ask L2 for columns [k_start, k_end) of the weight rows w_pf [BLOCK_N, 1] (valid rows: a hint must not name
    memory outside the tensor): one prefetch per 64 two-byte elements, a 128-byte line."""
    LINES: tl.constexpr = BLOCK_K // 64
    for k0 in range(k_start, k_end, BLOCK_K):
        offs = tl.minimum(k0 + tl.arange(0, LINES) * 64, k_end - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [w_pf + offs[None, :]], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] bf16/fp16, unit stride along K ([M, 2K] with ACT: gate, then up)
    w_ptr,  # [N, K] bf16/fp16, unit stride along K
    b_ptr,  # [N] or unused
    norm_ptr,  # [K] RMSNorm weight applied to x first (NORM) or unused
    out_ptr,  # [M, N]
    part_ptr,  # [num_splits, M, N] float32 (SPLIT)
    counter_ptr,  # [>= N tiles] int32, zero between launches (SPLIT)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    num_splits,
    eps,  # RMSNorm epsilon (NORM)
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,  # x holds [gate, up]: the kernel's input is silu(gate) * up (models.activation)
    SWAP_AB: tl.constexpr,  # (USE_DOT) the weight tile is the MMA's A operand: the accumulator is out^T
    PREFETCH: tl.constexpr,  # (PDL, BLOCK_K >= 64) the program's weight slice is asked of L2 before the wait
    PDL: tl.constexpr,  # launched with programmatic dependent launch (graphrunner.pdl)
    PARTIALS: tl.constexpr = False,  # (SPLIT) store the float32 partials only: a consumer sums them (linear_add_norm)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + tl.minimum(rows, M - 1)[:, None].to(tl.int64) * stride_xm  # [M_PAD, 1]: padding re-reads M - 1
    # The row loop's PDL variant loads the first weight tile before the wait for the previous kernel (weights
    # are constant, so this read overlaps that kernel's tail; the rest reads x or writes, so it waits). The
    # tensor-core variant waits first and keeps its software-pipelined loop whole (peeling it out of that loop is
    # the suspect for L2's +30 µs with PDL on the H200, thirteenth session).
    if PDL and not USE_DOT:  # (constexprs: resolved at compile time)
        first_k = k_start + tl.arange(0, BLOCK_K)
        w_first = tl.load(w_rows + first_k[None, :], mask=n_mask[:, None] & (first_k < k_end)[None, :], other=0.0)
    if PREFETCH:
        prefetch_l2(w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn, k_start, k_end, BLOCK_K)
    if PDL:
        pdl_enter(PDL)
    inv = tl.zeros((M_PAD,), dtype=tl.float32)  # NORM: 1 / rms of each x row over all of K (every split needs it)
    if NORM:
        ss = tl.zeros((M_PAD,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if USE_DOT:
                xk = tl.load(x_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0).to(tl.float32)
                ss += tl.sum(xk * xk, axis=1)
            else:  # row by row through the same [BLOCK_K] reduction, as the products below
                for m in tl.static_range(M_PAD):
                    xk = tl.load(x_ptr + tl.minimum(M - 1, m) * stride_xm + offs_k, mask=offs_k < K,
                                 other=0.0).to(tl.float32)
                    ss = tl.where(rows == m, ss + tl.sum(xk * xk, axis=0), ss)
        inv = tl.rsqrt(ss / K + eps)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    loop_start = k_start
    if PDL and not USE_DOT:  # (without PDL the loop is the one measured on the H200, untouched)
        acc = _gemv_step(acc, w_first, k_start, k_end, K, x_ptr, x_rows, norm_ptr, inv, M, stride_xm, rows,
                         M_PAD, BLOCK_K, USE_DOT, NORM, ACT, SWAP_AB)
        loop_start = k_start + BLOCK_K
    for k0 in range(loop_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < k_end)[None, :], other=0.0)
        acc = _gemv_step(acc, w, k0, k_end, K, x_ptr, x_rows, norm_ptr, inv, M, stride_xm, rows,
                         M_PAD, BLOCK_K, USE_DOT, NORM, ACT, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)  # [M_PAD, BLOCK_N], as the epilogue stores it
    mask = (rows < M)[:, None] & n_mask[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part_rows = part_ptr + (pid_k * M + rows[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part_rows, acc, mask=mask)
    if SPLIT and not PARTIALS:
        tl.debug_barrier()  # every thread's partial is stored before the release below publishes them
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:  # the last split of this tile sums all partials, in split order
            total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for s in range(num_splits):
                src = part_ptr + (s * M + rows[:, None]).to(tl.int64) * N + offs_n[None, :]
                total += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")  # L2: other SMs wrote it
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # zero again for the next launch (and graph replay)


_MAX_TILES = 16384
_counters: dict[torch.device, Tensor] = {}


def _counter_buffer(device: torch.device) -> Tensor | None:
    """The split-K reduction's per-tile counters ([_MAX_TILES] int32 per device; kernel_checks.zeroed_counters)."""
    return zeroed_counters(_counters, device, _MAX_TILES)


def check_inputs(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool = False) -> None:
    """x [M <= MAX_M, K] (or [M, 2K] gated), weight [N, K] and bias [N] of one bf16/fp16 dtype and device."""
    check_tensor(x, "x", _DTYPES, 2, None)
    check_tensor(weight, "weight", x.dtype, 2, x.device)
    if bias is not None:
        check_tensor(bias, "bias", x.dtype, 1, x.device)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has {bias.shape[0]} entries, weight has {weight.shape[0]} rows")
    if gated and x.shape[1] != 2 * weight.shape[1]:
        raise ValueError(f"gate_up [M, {x.shape[1]}] must be [M, 2K] for weight [N, K = {weight.shape[1]}]")
    if not gated and x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, {x.shape[1]}] and weight [N, {weight.shape[1]}] disagree on K")
    if x.shape[0] > MAX_M:
        raise ValueError(f"the small-M kernels take at most {MAX_M} rows, got {x.shape[0]}")


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None, silu_mul: bool = False) -> Tensor:  # [M, N]
    """PyTorch reference: float32 accumulation of x [M, K] @ weight [N, K]^T (+ bias), cast to x's dtype. With
    silu_mul, x is a gate-up output [M, 2K] and the product's input is silu(gate) * up (models.activation)."""
    check_inputs(x, weight, bias, silu_mul)
    if silu_mul:
        x = silu_mul_ref(x)
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def split_plan(k: int, config: GemvConfig) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of splits, never an empty one) of a launch over K."""
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def launch_gemv(x: Tensor, weight: Tensor, bias: Tensor | None, norm: tuple[Tensor, float] | None, silu_mul: bool,
                cfg: GemvConfig, out: Tensor, part: Tensor, counters: Tensor | None, k_per_split: int, split_k: int,
                partials: bool = False) -> None:
    """One _gemv_kernel launch into out [M, N] (split_k > 1: through part [split_k, M, N] float32 and the tile
    counters; with `partials`, into part only, unsummed). x and weight unit stride along K."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    pdl = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split_k)](  # (unused pointers: `out` stands in)
        x, weight, bias if bias is not None else out, norm[0] if norm is not None else out, out, part,
        counters if counters is not None else out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        k_per_split, split_k, float(norm[1]) if norm is not None else 0.0,
        M_PAD=16 if cfg.use_dot else triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT=split_k > 1, HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot, NORM=norm is not None, ACT=silu_mul,
        SWAP_AB=cfg.swap_ab, PREFETCH=prefetch_on(pdl, cfg.block_k), PDL=pdl_mode(pdl, "gemv", m), PARTIALS=partials,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig | None = None,
                norm: tuple[Tensor, float] | None = None, silu_mul: bool = False) -> Tensor:
    """x [M <= 8, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, float32 accumulation. With
    norm = (RMSNorm weight [K], eps) x is normalised first, inside the kernel (models.norm.rms_norm's numerics);
    with silu_mul, x is [M, 2K] (gate, up) and the kernel's prologue makes silu(gate) * up (gemv_ref's contract)."""
    check_inputs(x, weight, bias, silu_mul)
    if norm is not None and silu_mul:
        raise ValueError("the GEMV prologue takes a norm or the gated activation, not both")
    if norm is not None:
        check_tensor(norm[0], "norm weight", x.dtype, 1, x.device)
        if norm[0].shape[0] != x.shape[1]:
            raise ValueError(f"norm weight [{norm[0].shape[0]}] does not match K = {x.shape[1]}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    if k == 0:  # (a norm over zero features is empty too)
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    cfg = config or default_config(n, k, x.device)
    tiles = triton.cdiv(n, cfg.block_n)
    k_per_split, split_k = split_plan(k, cfg)
    counters = _counter_buffer(x.device) if split_k > 1 and tiles <= _MAX_TILES else None
    if counters is None:  # (only before the first eager call on a device, or with too many tiles)
        k_per_split, split_k = k, 1
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    launch_gemv(x, weight, bias, norm, silu_mul, cfg, out, part, counters, k_per_split, split_k)
    return out


def small_m_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] -> [M, N]: the Triton GEMV with the tuned config of (N, K) serving M (decided at run time, so one
    traced graph serves every token count), else F.linear (cuBLAS). Traced: the opaque op graphrunner::small_m_linear
    (graphrunner/opaque.py), as are the two below."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.small_m_linear(x, weight, bias)
    return _small_m_linear(x, weight, bias)


def _small_m_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    config = config_for(x.shape[0], weight.shape[0], weight.shape[1], x.device) if x.device.type == "cuda" \
        else None
    if config is None or x.dtype not in _DTYPES:
        return F.linear(x, weight, bias)
    return gemv_triton(x, weight, bias, config)


@opaque_op("small_m_linear", _small_m_linear).register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def small_m_silu_mul_linear(gate_up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """linear(silu(gate) * up) for gate_up [M, 2K] -> [M, N]: the GEMV with the activation in its prologue where a
    row-loop config serves M; otherwise one activation launch (silu_mul_triton on CUDA), then the tensor-core GEMV
    where its config serves M, else F.linear. (In the tensor-core GEMV the activation made the 0.6B shape's L2 step
    0.3 ms slower on the H200: its x tiles no longer stream straight to the tensor cores.)"""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.small_m_silu_mul_linear(gate_up, weight, bias)
    return _small_m_silu_mul_linear(gate_up, weight, bias)


def _small_m_silu_mul_linear(gate_up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    cuda = gate_up.device.type == "cuda"
    config = config_for(gate_up.shape[0], weight.shape[0], weight.shape[1], gate_up.device) \
        if cuda and gate_up.dtype in _DTYPES else None
    if config is not None and not config.use_dot:
        return gemv_triton(gate_up, weight, bias, config, silu_mul=True)
    act = silu_mul_triton(gate_up) if cuda else silu_mul_ref(gate_up)
    return gemv_triton(act, weight, bias, config) if config is not None else F.linear(act, weight, bias)


@opaque_op("small_m_silu_mul_linear", _small_m_silu_mul_linear).register_fake
def _(gate_up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return gate_up.new_empty(gate_up.shape[0], weight.shape[0])


def small_m_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    """linear(rms_norm(x)) for x [M, K] -> [M, N]: the GEMV with the norm in its prologue where a tuned config
    serves M, else the norm (rms_norm_any: one launch on CUDA) and F.linear."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.small_m_norm_linear(x, norm_weight, eps, weight, bias)
    return _small_m_norm_linear(x, norm_weight, eps, weight, bias)


def _small_m_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    config = config_for(x.shape[0], weight.shape[0], weight.shape[1], x.device) if x.device.type == "cuda" \
        else None
    if config is not None and x.dtype in _DTYPES:
        return gemv_triton(x, weight, bias, config, norm=(norm_weight, eps))
    return F.linear(rms_norm_any(x, norm_weight, eps), weight, bias)


@opaque_op("small_m_norm_linear", _small_m_norm_linear).register_fake
def _(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
