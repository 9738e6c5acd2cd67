"""RMSNorm with Hugging Face numerics: normalise in float32, cast back, then scale by the weight.

Used for the per-layer norms, the final norm and Qwen3's per-head q/k norms.
"""

from __future__ import annotations

import torch
from torch import nn


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
