"""RMSNorm with Hugging Face numerics: normalise in float32, cast back, then scale by the weight.

Used for the per-layer norms, the final norm and Qwen3's per-head q/k norms. `rms_norm` is the PyTorch form (the
reference); `rms_norm_triton` the one-launch kernel the small-M linear falls back to for larger token counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from graphrunner.kernel_checks import check_tensor


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistics computed in float32 like HF."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden_size]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden_size] -> same shape and dtype."""
        return rms_norm(x, self.weight, self.eps)

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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * (h * inv).to(x.dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


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
