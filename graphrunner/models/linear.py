"""Linear layers: `linear` (F.linear, or the small-M Triton GEMV when GRAPHRUNNER_GEMV=1), `Linear` (nn.Linear
that calls it) and `MergedLinear`, whose output is several HF projections stacked along the output dimension.

`output_sizes` records the stacked pieces in order, so the loader can copy each checkpoint shard
(`q_proj`, `k_proj`, `v_proj` or `gate_proj`, `up_proj`) into its slice of the fused weight/bias.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.models import gemv  # noqa: F401  (registers torch.ops.graphrunner.small_m_linear)

# Read once at import (a constant to torch.compile): 1 routes CUDA bf16/fp16 linears through
# graphrunner::small_m_linear, which picks the Triton GEMV for <= gemv.MAX_M tokens at run time.
GEMV_ENABLED: bool = os.environ.get("GRAPHRUNNER_GEMV", "0") == "1"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]."""
    if GEMV_ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        out = torch.ops.graphrunner.small_m_linear(x.reshape(-1, x.shape[-1]), weight, bias)  # [T, N]
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear` (same parameters, same checkpoint names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """nn.Linear with weight [sum(output_sizes), in_features]; one matmul for several projections."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes: tuple[int, ...] = tuple(int(s) for s in output_sizes)

    def shard_slice(self, shard: int) -> slice:
        """Rows of the fused weight (and bias) that hold the `shard`-th projection."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """out [..., sum(output_sizes)] -> one view per projection."""
        return out.split(list(self.output_sizes), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, output_sizes={self.output_sizes}"
