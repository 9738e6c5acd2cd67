"""The MLP's gate-up projection with silu(gate) * up in its epilogue, at small token counts: one tensor-core kernel
from x [M <= 8, K] to the activation [M, I], where the gate-up GEMV and the activation kernel were two launches.
The op `graphrunner::small_m_gated_mlp` (x -> down(silu(gate) * up)) picks it, or the two-op path, from the
token count at run time. On by default; GRAPHRUNNER_GEMV_GATED_ACT=0 turns it off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.env import env_choice
from graphrunner.models import gemv
from graphrunner.models.activation import silu_mul, silu_mul_ref
from graphrunner.models.gemv import GemvConfig, config_for, prefetch_l2
from graphrunner.opaque import opaque_op
from graphrunner.pdl import pdl_enter, pdl_mode, use_pdl

ENABLED = env_choice("GRAPHRUNNER_GEMV_GATED_ACT", ("0", "1"), "1") == "1"
# Each program's gate and up rows form one weight tile and one tl.dot (2 * 32 rows: Hopper's wgmma, whose M is 64 a
# warpgroup) instead of a dot per half (32 rows each: mma.sync through ldmatrix). On by default: L2 at batch 8 -14.5
# µs on an H100 (docs/BENCHMARKS.md, forty-third session); GRAPHRUNNER_GEMV_GATED_ONE_DOT=0 keeps two dots
ONE_DOT = env_choice("GRAPHRUNNER_GEMV_GATED_ONE_DOT", ("0", "1"), "1") == "1"


def fusable(config: GemvConfig | None) -> bool:
    """Whether the gate-up weight's config for this M can run fused: the swapped tensor-core path in one K split
    (the epilogue needs a program's whole sums), with at least 16 rows of each half per program."""
    return config is not None and config.use_dot and config.swap_ab and config.split_k == 1 and config.block_n >= 32


def gate_up_act_ref(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # [M, I]
    """PyTorch reference: the gate-up product [M, 2I] rounded to x's dtype (gemv_ref), then silu_mul_ref."""
    return silu_mul_ref(gemv.gemv_ref(x, weight, bias))


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # [M, K] bf16/fp16, unit stride along K
    w_ptr,  # [2I, K]: gate rows, then up rows, unit stride along K
    b_ptr,  # [2I] or unused
    out_ptr,  # [M, I]
    M,
    I,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,  # features of each half per program
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
    ONE_DOT: tl.constexpr,  # gate and up rows in one [2 * BLOCK_N, BLOCK_K] tile and one tl.dot (module switch)
):
    rows = tl.arange(0, 16)  # x padded to 16 rows (re-reading row M - 1): one instruction shape whatever M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    x_rows = x_ptr + tl.minimum(rows, M - 1)[:, None].to(tl.int64) * stride_xm  # [16, 1]
    if PREFETCH:  # (weights are constant: asked of L2 while the kernel before still runs)
        valid = tl.minimum(offs_n, I - 1)[:, None]
        prefetch_l2(w_ptr + valid.to(tl.int64) * stride_wn, 0, K, BLOCK_K)
        prefetch_l2(w_ptr + (valid + I).to(tl.int64) * stride_wn, 0, K, BLOCK_K)
    if PDL:
        pdl_enter(PDL)
    # ONE_DOT: tile row r < BLOCK_N is gate feature offs_n[r], row BLOCK_N + r its up row ([2 * BLOCK_N, BK] a step)
    r = tl.arange(0, 2 * BLOCK_N)
    feat = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    gu_rows = w_ptr + (feat + (r // BLOCK_N) * I)[:, None].to(tl.int64) * stride_wn  # [2 * BLOCK_N, 1]
    g_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1] (two dots)
    u_rows = w_ptr + (offs_n + I)[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((2 * BLOCK_N, 16), dtype=tl.float32)  # (one dot: gate^T over up^T)
    acc_g = tl.zeros((BLOCK_N, 16), dtype=tl.float32)  # gate^T and up^T, as the swapped GEMV accumulates
    acc_u = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.trans(tl.load(x_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0))  # [BK, 16]
        if ONE_DOT:
            w_mask = (feat < I)[:, None] & k_mask[None, :]
            acc = tl.dot(tl.load(gu_rows + offs_k[None, :], mask=w_mask, other=0.0), xt, acc)
        else:
            w_mask = n_mask[:, None] & k_mask[None, :]
            acc_g = tl.dot(tl.load(g_rows + offs_k[None, :], mask=w_mask, other=0.0), xt, acc_g)
            acc_u = tl.dot(tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0), xt, acc_u)
    if ONE_DOT:  # [2 * BN, 16] -> [2, BN, 16] -> [BN, 16, 2] -> gate^T, up^T (order-keeping reshape)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, 16)), (1, 2, 0)))
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        acc_u += tl.load(b_ptr + I + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    act = silu_mul(acc_g.to(dtype), acc_u.to(dtype))  # the gate-up output's rounding, then the activation's
    out = out_ptr + rows[None, :].to(tl.int64) * stride_om + offs_n[:, None]  # act is out^T [BLOCK_N, 16]
    tl.store(out, act, mask=n_mask[:, None] & (rows < M)[None, :])


def gate_up_act_triton(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig,
                       one_dot: bool | None = None) -> Tensor:  # [M, I]
    """gate_up_act_ref's contract in one kernel, under a fusable config of the gate-up weight [2I, K] (its
    block_n split between the halves). one_dot: one tl.dot over both halves' rows (default: ONE_DOT)."""
    one_dot = ONE_DOT if one_dot is None else one_dot
    gemv.check_inputs(x, weight, bias)
    if weight.shape[0] % 2:
        raise ValueError(f"gate_up weight [{weight.shape[0]}, K] must hold gate and up halves of equal height")
    if not fusable(config):
        raise ValueError(f"{config} cannot run fused (needs use_dot, swap_ab, split_k 1 and block_n >= 32)")
    m, k, half = x.shape[0], x.shape[1], weight.shape[0] // 2
    out = torch.empty(m, half, dtype=x.dtype, device=x.device)
    if m == 0 or half == 0:
        return out
    if k == 0:
        return out.copy_(silu_mul_ref(bias.expand(m, 2 * half))) if bias is not None else out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    block_n = config.block_n // 2
    pdl = use_pdl(x.device)
    _gate_up_act_kernel[(triton.cdiv(half, block_n),)](
        x, weight, bias if bias is not None else out, out, m, half, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=config.block_k, HAS_BIAS=bias is not None,
        PREFETCH=gemv.prefetch_on(pdl, config.block_k), PDL=pdl_mode(pdl, "gate_up_act", m),
        ONE_DOT=one_dot, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )
    return out


def small_m_gated_mlp(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor,
                      down_bias: Tensor | None) -> Tensor:
    """down(silu(gate) * up) for x [M, K] -> [M, H]: the fused gate-up kernel where the gate-up weight's config
    serving M is fusable, then the down projection's GEMV (or cuBLAS); otherwise the gate-up op, then the down
    projection with the activation (`small_m_silu_mul_linear`). Traced: the opaque op graphrunner::small_m_gated_mlp
    (graphrunner/opaque.py)."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.small_m_gated_mlp(x, gate_up_weight, gate_up_bias, down_weight, down_bias)
    return _small_m_gated_mlp(x, gate_up_weight, gate_up_bias, down_weight, down_bias)


def _small_m_gated_mlp(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor,
                       down_bias: Tensor | None) -> Tensor:
    cuda = x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
    config = config_for(x.shape[0], gate_up_weight.shape[0], gate_up_weight.shape[1], x.device) if cuda else None
    if fusable(config):
        assert config is not None
        act = gate_up_act_triton(x, gate_up_weight, gate_up_bias, config)
        return gemv.small_m_linear(act, down_weight, down_bias)
    return gemv.small_m_silu_mul_linear(gemv.small_m_linear(x, gate_up_weight, gate_up_bias), down_weight, down_bias)


@opaque_op("small_m_gated_mlp", _small_m_gated_mlp).register_fake
def _(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor,
      down_bias: Tensor | None) -> Tensor:
    return x.new_empty(x.shape[0], down_weight.shape[0])
