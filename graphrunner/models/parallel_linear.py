"""Tensor-parallel layers: column-parallel fused linears (QKV, gate-up), the row-parallel linear that
all-reduces its output, and the vocab-parallel embedding and LM head.

Each holds only this rank's part (sizes read from graphrunner.parallel_state when it is built) and says which
part of a full checkpoint tensor is its own (`tp_shard_of`, used by the loader). With one rank every layer is
the plain layer: same parameters, same arithmetic, no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.models import linear_add_norm
from graphrunner.models.linear import Linear, MergedLinear, linear, silu_mul_linear
from graphrunner.models.norm import RMSNorm, add_rms_norm
from graphrunner.parallel_state import tp_all_gather, tp_all_reduce, tp_rank, tp_size, vocab_range


class ShardedMergedLinear(MergedLinear):
    """A column-parallel MergedLinear: piece p is rows [start_p, start_p + size_p) of its full projection.

    `pieces` holds (start, size) per stacked projection in checkpoint rows; the local weight stacks the sizes.
    """

    def __init__(self, in_features: int, pieces: Sequence[tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, [size for _, size in pieces], bias=bias)
        self.world = tp_size()
        self.row_starts: tuple[int, ...] = tuple(int(start) for start, _ in pieces)

    def tp_shard_of(self, param: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of checkpoint projection `shard` (weight [F, in] or bias [F])."""
        if shard < 0:  # the fused tensor itself (not an HF name): only whole, on one rank
            if self.world == 1:
                return tensor
            raise ValueError(f"{param} of a fused linear must be loaded per projection with tensor parallelism")
        return tensor.narrow(0, self.row_starts[shard], self.output_sizes[shard])


class RowParallelLinear(Linear):
    """Input features split over the ranks; partial products are summed by an all-reduce, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self.world = tp_size()
        if in_features % self.world:
            raise ValueError(f"{in_features} input features do not split over tensor_parallel_size={self.world}")
        local = in_features // self.world
        super().__init__(local, out_features, bias=bias)
        self.in_start = tp_rank() * local

    def tp_shard_of(self, param: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(1, self.in_start, self.in_features) if param == "weight" else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / world] -> [T, out], the full sum on every rank."""
        if self.world == 1:
            return super().forward(x)
        return self.reduce(linear(x, self.weight))

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up [T, 2 * in / world] (this rank's gate and up slices)."""
        if self.world == 1:
            return super().forward_gated(gate_up)
        return self.reduce(silu_mul_linear(gate_up, self.weight))

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + self(x)), residual + self(x)): one op (models.linear_add_norm) where it routes and the
        weight is whole (with tensor parallelism the sum is all-reduced first: the add_rms_norm op after it)."""
        if self.world == 1 and linear_add_norm.routes(x, self.weight):
            return linear_add_norm.linear_add_rms_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps)
        return add_rms_norm(self(x), residual, norm.weight, norm.eps)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products summed, then the bias added once."""
        out = tp_all_reduce(partial)
        return out if self.bias is None else out + self.bias


def _vocab_rows(tensor: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a [V, H] tensor, zero-padded past V (the last rank's padding)."""
    part = tensor[start:start + rows]
    if part.shape[0] == rows:
        return part
    return torch.cat([part, part.new_zeros((rows - part.shape[0], *tensor.shape[1:]))])


class _VocabRows(nn.Module):
    """A [V, H] weight whose vocabulary rows are split over the ranks (this rank's ceil(V / world) rows)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.world = tp_size()
        self.vocab_size = vocab_size
        self.vocab_start, rows = vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))  # [ceil(V / world), H]

    def tp_shard_of(self, param: str, shard: int, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(tensor, self.vocab_start, self.weight.shape[0])


class VocabParallelEmbedding(_VocabRows):
    """Embedding whose rows (token ids) are split over the ranks; each rank looks up its ids, zeroes the others,
    and an all-reduce sums the (one non-zero) contributions."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, H]."""
        if self.world == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [T] bool
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows={self.weight.shape[0]} from {self.vocab_start}, hidden={self.weight.shape[1]}"


class ParallelLMHead(_VocabRows):
    """The LM head's vocabulary rows split like VocabParallelEmbedding (whose weight it may share)."""


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """hidden [N, H] x this rank's vocabulary rows weight [V / world, H] -> full logits [N, V] float32 on every rank
    (the shards all-gathered; each rank then samples the same token from the same logits)."""
    logits = tp_all_gather(linear(hidden, weight))  # [N, world * V / world]
    if logits.shape[-1] != vocab_size:
        logits = logits[:, :vocab_size].contiguous()
    return logits.float()
