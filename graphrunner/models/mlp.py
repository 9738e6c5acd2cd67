"""The gated SiLU MLP of Llama/Qwen: down(silu(gate(x)) * up(x)) with gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.models.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """gate_up_proj holds [gate_proj; up_proj] stacked along the output dimension."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size), bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # each [T, I]
        return self.down_proj(F.silu(gate) * up)
