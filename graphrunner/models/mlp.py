"""The gated SiLU MLP of Llama/Qwen: down(silu(gate(x)) * up(x)) with gate and up fused; with tensor
parallelism gate-up is split column-wise (each rank its slice of the intermediate size) and down row-wise."""

from __future__ import annotations

import torch
from torch import nn

from graphrunner.models import gate_up_act, gemv, linear_add_norm
from graphrunner.models.gemv import routes_to_gemv
from graphrunner.models.norm import RMSNorm, add_rms_norm
from graphrunner.models.parallel_linear import RowParallelLinear, ShardedMergedLinear
from graphrunner.parallel_state import shard_range


class GatedMLP(nn.Module):
    """gate_up_proj holds [gate_proj; up_proj] stacked along the output dimension."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        start, self.intermediate_size = shard_range(intermediate_size)  # this rank's slice
        piece = (start, self.intermediate_size)
        self.gate_up_proj = ShardedMergedLinear(hidden_size, (piece, piece), bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `norm`: the layer's post-attention norm, applied here (models.linear.
        norm_linear may fold it into gate_up)."""
        if self._one_op(x, norm):
            gate_up, down = self.gate_up_proj, self.down_proj
            h = x if norm is None else norm(x)
            bias = down.bias if down.world == 1 else None  # (with TP it is added once, after the all-reduce)
            out = gate_up_act.small_m_gated_mlp(h, gate_up.weight, gate_up.bias, down.weight, bias)
            return out if down.world == 1 else down.reduce(out)
        gate_up = self.gate_up_proj(x) if norm is None else self.gate_up_proj.forward_normed(x, norm)  # [T, 2I]
        return self.down_proj.forward_gated(gate_up)  # (models.linear.silu_mul_linear may fold the activation in)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + self(x)), residual + self(x)), x already normed: one op (models.linear_add_norm) where
        the MLP is one op and the down weight whole, so the down GEMV's split partials go straight to the add + norm."""
        down = self.down_proj
        if self._one_op(x, None) and down.world == 1 and linear_add_norm.routes(x, down.weight):
            gate_up = self.gate_up_proj
            return linear_add_norm.gated_mlp_add_rms_norm(x, gate_up.weight, gate_up.bias, down.weight, down.bias,
                                                          residual, norm.weight, norm.eps)
        return add_rms_norm(self(x), residual, norm.weight, norm.eps)

    def _one_op(self, x: torch.Tensor, norm: RMSNorm | None) -> bool:
        """Whether the MLP runs as `graphrunner::small_m_gated_mlp` (GRAPHRUNNER_GEMV_GATED_ACT=1, both weights
        GEMV-routed, and no norm to fold into the gate-up GEMV's prologue): decided at trace time."""
        w = self.gate_up_proj.weight
        return (gate_up_act.ENABLED and gemv.ACT_PROLOGUE and not (norm is not None and gemv.NORM_PROLOGUE)
                and x.dim() == 2 and x.dtype == w.dtype and routes_to_gemv(w) and routes_to_gemv(self.down_proj.weight))
