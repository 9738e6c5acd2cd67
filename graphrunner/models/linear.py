"""A linear layer whose output is several HF projections stacked along the output dimension.

`output_sizes` records the stacked pieces in order, so the loader can copy each checkpoint shard
(`q_proj`, `k_proj`, `v_proj` or `gate_proj`, `up_proj`) into its slice of the fused weight/bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MergedLinear(nn.Linear):
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
