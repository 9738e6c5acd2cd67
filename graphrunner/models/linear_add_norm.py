"""A projection feeding the residual add and the RMSNorm after it, as one op: o_proj with the post-attention norm,
the MLP's down projection with the next layer's input norm. Where the projection's GEMV config splits K at this
token count, the GEMV stores its float32 split partials and the add + norm kernel sums them in split order, so the
GEMV skips its split-K tail (an atomic, then the last program re-reading every partial: ~1.7 µs a call at M = 8 on
the H200, docs/BENCHMARKS.md). Bit-equal to the projection then add_rms_norm. GRAPHRUNNER_GEMV_PARTIALS=0: off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.env import env_choice
from graphrunner.kernel_checks import check_tensor, interpreted
from graphrunner.models import gate_up_act, gemv
from graphrunner.models import norm as norm_mod
from graphrunner.models.activation import silu_mul_triton
from graphrunner.models.gemv import GemvConfig, config_for, routes_to_gemv, split_plan
from graphrunner.models.norm import add_norm_row, add_rms_norm_ref
from graphrunner.opaque import opaque_op
from graphrunner.pdl import pdl_enter, pdl_mode, use_pdl

ENABLED = env_choice("GRAPHRUNNER_GEMV_PARTIALS", ("0", "1"), "1") == "1"


def routes(x: Tensor, weight: Tensor) -> bool:
    """Whether the decoder hands this projection and the add + norm after it to one op of this module (decided at
    trace time, from metadata): the switch on, and a weight `linear()` would send to the GEMV."""
    return ENABLED and x.dim() == 2 and routes_to_gemv(weight)


def split_config(m: int, weight: Tensor, device: torch.device) -> GemvConfig | None:
    """The GEMV config serving M tokens of weight [N, K], where it splits K (the partials path); else None."""
    n, k = weight.shape
    config = config_for(m, n, k, device) if k else None
    return config if config is not None and split_plan(k, config)[1] > 1 else None


def gemv_partials(x: Tensor, weight: Tensor, config: GemvConfig, out: Tensor | None = None) -> Tensor:  # [S, M, N]
    """x [M <= 8, K] @ weight [N, K]^T as the GEMV's S split-K partials (split_plan(K, config)), unsummed, float32;
    into `out` [S, M, N] (contiguous) where given."""
    gemv.check_inputs(x, weight, None)
    m, k, n = x.shape[0], x.shape[1], weight.shape[0]
    if k == 0:
        raise ValueError("gemv_partials needs K >= 1")
    k_per_split, splits = split_plan(k, config)
    if out is not None and (out.shape != (splits, m, n) or out.dtype != torch.float32 or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous float32 [{splits}, {m}, {n}], got {tuple(out.shape)} {out.dtype}")
    part = out if out is not None else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return part
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    gemv.launch_gemv(x, weight, None, None, False, config, part, part, None, k_per_split, splits, partials=True)
    return part


def partials_add_rms_norm_ref(parts: Tensor, bias: Tensor | None, residual: Tensor, weight: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    """PyTorch reference: the partials [S, T, D] float32 summed in split order from zero (the GEMV's own split-K
    sum), plus the bias, rounded to the residual's dtype: the projection's output; then add_rms_norm_ref."""
    total = torch.zeros_like(parts[0])
    for s in range(parts.shape[0]):
        total = total + parts[s]
    if bias is not None:
        total = total + bias.float()
    return add_rms_norm_ref(total.to(residual.dtype), residual, weight, eps)


@triton.jit
def _partials_add_norm_kernel(part_ptr, b_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, T, stride_r, stride_o, stride_s,
                              D, eps, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a constant weight: read before the wait (norm.add_norm_row)
    if PDL:  # the partials are the previous kernel's output: nothing else is read before the wait
        pdl_enter(PDL)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # the GEMV tail's order: ((0 + p0) + p1) + ...
        total += tl.load(part_ptr + (s * T + row) * D + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = total.to(res_ptr.dtype.element_ty)
    add_norm_row(x, w, res_ptr, out_ptr, sum_ptr, row, offs, mask, stride_r, stride_o, stride_s, D, eps)


def partials_add_rms_norm_triton(parts: Tensor, bias: Tensor | None, residual: Tensor, weight: Tensor,
                                 eps: float) -> tuple[Tensor, Tensor]:
    """partials_add_rms_norm_ref's contract in one launch, a program per row (residual [T, D], unit stride along
    D; parts [S, T, D] float32, contiguous)."""
    check_tensor(parts, "parts", torch.float32, 3, None)
    check_tensor(residual, "residual", (torch.float32, torch.bfloat16, torch.float16), 2, parts.device)
    check_tensor(weight, "weight", residual.dtype, 1, parts.device)
    if bias is not None:
        check_tensor(bias, "bias", residual.dtype, 1, parts.device)
    t, d = residual.shape
    if (parts.shape[1:] != (t, d) or not parts.is_contiguous() or residual.stride(1) != 1 or weight.shape[0] != d
            or (bias is not None and bias.shape[0] != d) or parts.shape[0] < 1):
        raise ValueError(f"parts {tuple(parts.shape)} (contiguous, at least one split), residual {tuple(residual.shape)}"
                         f" (unit stride along D), weight [{weight.shape[0]}] and bias must agree on [T, D]")
    out, summed = torch.empty_like(residual), torch.empty_like(residual)
    if t and d:
        pdl = use_pdl(parts.device)
        _partials_add_norm_kernel[(t,)](
            parts, bias if bias is not None else parts, residual, weight, out, summed, t, residual.stride(0),
            out.stride(0), summed.stride(0), d, eps, SPLITS=parts.shape[0], HAS_BIAS=bias is not None,
            BLOCK=triton.next_power_of_2(d), PDL=pdl_mode(pdl, "partials_add_norm", t), num_warps=norm_mod.ADD_NORM_WARPS,
            launch_pdl=pdl)
    return out, summed


def _on_gpu(x: Tensor) -> bool:
    return x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and not interpreted()


def linear_add_rms_norm(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps) for x [M, K] -> (normed, summed), each
    [M, N]: the GEMV's partials and the add + norm kernel where the config serving M splits K, otherwise the small-M
    linear op's path, then add_rms_norm. Traced: the opaque op graphrunner::linear_add_rms_norm."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps)
    return _linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps)


def _linear_add_rms_norm(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
                         eps: float) -> tuple[Tensor, Tensor]:
    config = split_config(x.shape[0], weight, x.device) if _on_gpu(x) else None
    if config is None:
        return norm_mod._add_rms_norm(gemv._small_m_linear(x, weight, bias), residual, norm_weight, eps)
    return partials_add_rms_norm_triton(gemv_partials(x, weight, config), bias, residual, norm_weight, eps)


@opaque_op("linear_add_rms_norm", _linear_add_rms_norm).register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
      eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(residual), torch.empty_like(residual)


def gated_mlp_add_rms_norm(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor,
                           down_bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    """add_rms_norm(small_m_gated_mlp(x, ...), residual, norm_weight, eps) -> (normed, summed): where the down
    projection's config serving M splits K and the activation is its own tensor there (the fused gate-up kernel, or
    the activation launch before a tensor-core GEMV), the down GEMV's partials and the add + norm kernel; otherwise
    the gated MLP op's path, then add_rms_norm. Traced: the opaque op graphrunner::gated_mlp_add_rms_norm."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.gated_mlp_add_rms_norm(x, gate_up_weight, gate_up_bias, down_weight, down_bias,
                                                            residual, norm_weight, eps)
    return _gated_mlp_add_rms_norm(x, gate_up_weight, gate_up_bias, down_weight, down_bias, residual, norm_weight, eps)


def _gated_mlp_add_rms_norm(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor,
                            down_bias: Tensor | None, residual: Tensor, norm_weight: Tensor,
                            eps: float) -> tuple[Tensor, Tensor]:
    m = x.shape[0]
    down = split_config(m, down_weight, x.device) if _on_gpu(x) else None
    act = None
    if down is not None:  # the activation as _small_m_gated_mlp makes it at this M (the same kernels)
        gate_up = config_for(m, gate_up_weight.shape[0], gate_up_weight.shape[1], x.device)
        if gate_up_act.fusable(gate_up):
            assert gate_up is not None
            act = gate_up_act.gate_up_act_triton(x, gate_up_weight, gate_up_bias, gate_up)
        elif down.use_dot:  # (a row-loop down GEMV takes the activation in its prologue instead: that path below)
            act = silu_mul_triton(gemv._small_m_linear(x, gate_up_weight, gate_up_bias))
    if down is None or act is None:
        mlp = gate_up_act._small_m_gated_mlp(x, gate_up_weight, gate_up_bias, down_weight, down_bias)
        return norm_mod._add_rms_norm(mlp, residual, norm_weight, eps)
    return partials_add_rms_norm_triton(gemv_partials(act, down_weight, down), down_bias, residual, norm_weight, eps)


@opaque_op("gated_mlp_add_rms_norm", _gated_mlp_add_rms_norm).register_fake
def _(x: Tensor, gate_up_weight: Tensor, gate_up_bias: Tensor | None, down_weight: Tensor, down_bias: Tensor | None,
      residual: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(residual), torch.empty_like(residual)
