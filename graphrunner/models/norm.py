"""RMSNorm with Hugging Face numerics: normalise in float32, cast back, then scale by the weight.

Used for the per-layer norms, the final norm and Qwen3's per-head q/k norms. `rms_norm` is the PyTorch form (the
reference); `rms_norm_triton` the one-launch kernel the small-M linear falls back to for larger token counts.
`add_rms_norm` is the decoder's residual add and the next norm in one op (GRAPHRUNNER_FUSED_ADD_NORM=1): a Triton
kernel on CUDA that can take programmatic dependent launch, so a decode layer's kernels chain without a gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from graphrunner.env import env_choice, env_number
from graphrunner.kernel_checks import check_tensor, interpreted
from graphrunner.opaque import fusing_trace, opaque_op
from graphrunner.pdl import pdl_enter, pdl_mode, use_pdl

# GRAPHRUNNER_FUSED_ADD_NORM=1: the decoder's residual adds and the norms after them run as graphrunner::add_rms_norm
# (models.decoder); on by default, measured on the H200 (docs/DECISIONS.md)
FUSED_ADD_NORM = env_choice("GRAPHRUNNER_FUSED_ADD_NORM", ("0", "1"), "1") == "1"
# warps of the add + norm kernels' one program per row (here and in linear_add_norm). A decode step's rows are few,
# each a latency chain (wait, load the row or its 4-8 float32 partial rows, reduce, store), so more warps keep more
# loads in flight: 8 took L2 at batch 8 from 1.008 to 0.971 ms on an H100, 16 gave 0.976, batch 1-4 and T1 did not
# move (docs/DECISIONS.md). GRAPHRUNNER_ADD_NORM_WARPS sets it
ADD_NORM_WARPS = int(env_number("GRAPHRUNNER_ADD_NORM_WARPS", 8, integer=True, rule="in (1, 2, 4, 8, 16)",
                                valid=lambda v: v in (1, 2, 4, 8, 16)))


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistics computed in float32 like HF."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden_size]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden_size] -> same shape and dtype."""
        return rms_norm_any(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * (x / sqrt(mean(x^2) + eps)), statistics in float32, cast back before the weight."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)  # [..., 1] float32
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@triton.jit
def normed_tile(x, inv, w):
    """HF's RMSNorm on a loaded tile: x * (1 / rms) in float32, cast back to x's dtype, then times the weight (the
    result in x's dtype). Shared by the kernels here and the GEMV's norm prologue."""
    return (w.to(tl.float32) * (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, normed_tile(x, inv, w), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of x [T, D] (unit stride along D) in one launch, a program per row."""
    check_tensor(x, "x", (torch.float32, torch.bfloat16, torch.float16), 2, None)
    check_tensor(weight, "weight", x.dtype, 1, x.device)
    if weight.shape[0] != x.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x [T, {x.shape[1]}] (unit stride along D) does not match weight [{weight.shape[0]}]")
    out = torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)
    return out


def rms_norm_any(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of x [..., D]: one Triton launch for a CUDA call on x [T, D] (an uncompiled engine's norms would
    otherwise be eight PyTorch kernels; traced for the eager piece compiler: the op graphrunner::rms_norm); the
    PyTorch form while traced for Inductor (which fuses it with its neighbours), on CPU and under Triton's
    interpreter."""
    if (x.device.type == "cuda" and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype
            and not fusing_trace() and not interpreted()):
        if torch.compiler.is_compiling():
            return torch.ops.graphrunner.rms_norm(x, weight, eps)
        return rms_norm_triton(x, weight, eps)
    return rms_norm(x, weight, eps)


@opaque_op("rms_norm", rms_norm_triton).register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) with eager PyTorch's numerics: the sum rounded to the dtype, then
    normalised. x and residual [T, D], weight [D]."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, D, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a constant weight: read before the wait
    if PDL:  # x is the previous kernel's output: nothing else is read before the wait
        pdl_enter(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    add_norm_row(x, w, res_ptr, out_ptr, sum_ptr, row, offs, mask, stride_r, stride_o, stride_s, D, eps)


@triton.jit
def add_norm_row(x, w, res_ptr, out_ptr, sum_ptr, row, offs, mask, stride_r, stride_o, stride_s, D, eps):
    """One row of add_rms_norm_ref from its loaded x [BLOCK] (the residual's dtype) and norm weight w [BLOCK]: the
    sum stored, then its norm. The callers load w before their PDL wait: after the sum of squares' reduction it
    would be one more memory round trip on the step's critical path (the compiler does not hoist it across the
    reduction's barrier). Shared with linear_add_norm's kernel, whose x is a projection's split-K partials summed."""
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
    summed = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # rounded like eager PyTorch's add
    tl.store(sum_ptr + row * stride_s + offs, summed, mask=mask)
    h = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    tl.store(out_ptr + row * stride_o + offs, normed_tile(summed, inv, w), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref's contract in one launch, a program per row (x and residual [T, D], unit stride along D)."""
    check_tensor(x, "x", (torch.float32, torch.bfloat16, torch.float16), 2, None)
    check_tensor(residual, "residual", x.dtype, 2, x.device)
    check_tensor(weight, "weight", x.dtype, 1, x.device)
    if residual.shape != x.shape or weight.shape[0] != x.shape[1] or x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} (unit stride along D) must match "
                         f"each other and weight [{weight.shape[0]}]")
    out, summed = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        pdl = use_pdl(x.device)
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, summed, x.stride(0), residual.stride(0),
                                            out.stride(0), summed.stride(0), x.shape[1], eps,
                                            BLOCK=triton.next_power_of_2(x.shape[1]),
                                            PDL=pdl_mode(pdl, "add_norm", x.shape[0]), num_warps=ADD_NORM_WARPS,
                                            launch_pdl=pdl)
    return out, summed


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the Triton kernel on CUDA, the PyTorch form elsewhere (and under
    Triton's interpreter). Opaque to torch.compile (the op graphrunner::add_rms_norm), so Inductor keeps it one
    launch; eager calls skip the dispatcher (graphrunner/opaque.py)."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.device.type == "cuda" and not interpreted():
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


@opaque_op("add_rms_norm", _add_rms_norm).register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)
