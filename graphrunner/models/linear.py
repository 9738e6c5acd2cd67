"""Linear layers: `linear` (cuBLAS, or the small-M Triton GEMV of models/gemv.py: the shapes in gemv_configs.json
at the token counts their measured H200 configs serve, other shapes at one or two tokens; docs/DECISIONS.md),
`Linear` (nn.Linear that calls it) and `MergedLinear`, whose output is several HF projections stacked along the
output dimension.

`output_sizes` records the stacked pieces in order, so the loader can copy each checkpoint shard
(`q_proj`, `k_proj`, `v_proj` or `gate_proj`, `up_proj`) into its slice of the fused weight/bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.models import gemv
from graphrunner.models.gemv import routes_to_gemv
from graphrunner.models.norm import RMSNorm, rms_norm_any


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]. A weight the GEMV serves (`gemv.serves`) goes through
    the opaque op `graphrunner::small_m_linear`, which picks the GEMV or cuBLAS from the token count at run time."""
    if x.dim() == 2 and routes_to_gemv(weight):
        return gemv.small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(rms_norm(x)): with GRAPHRUNNER_GEMV_NORM=1 and a weight the GEMV serves, the op
    `graphrunner::small_m_norm_linear` (the norm inside the GEMV's prologue at small token counts); otherwise
    exactly the norm, then `linear`."""
    if gemv.NORM_PROLOGUE and x.dim() == 2 and norm_weight.dtype == weight.dtype and routes_to_gemv(weight):
        return gemv.small_m_norm_linear(x, norm_weight, eps, weight, bias)
    return linear(rms_norm_any(x, norm_weight, eps), weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up) for gate_up [T, 2K] (gate, then up): with GRAPHRUNNER_GEMV_ACT=1 and a weight the
    GEMV serves, the op `graphrunner::small_m_silu_mul_linear` (the activation inside the GEMV's prologue at small
    token counts); otherwise exactly the activation, then `linear`."""
    if gemv.ACT_PROLOGUE and gate_up.dim() == 2 and gate_up.dtype == weight.dtype and routes_to_gemv(weight):
        return gemv.small_m_silu_mul_linear(gate_up, weight, bias)
    gate, up = gate_up.chunk(2, dim=-1)
    return linear(F.silu(gate) * up, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear` (same parameters, same checkpoint names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """self(norm(x)), through norm_linear."""
        return norm_linear(x, norm.weight, norm.eps, self.weight, self.bias)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [T, 2 * in_features], through silu_mul_linear."""
        return silu_mul_linear(gate_up, self.weight, self.bias)


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
