"""Opaque ops (graphrunner/opaque.py): traced by Dynamo, each caller leaves one node of its custom op in the graph
(where the piecewise backend splits and Inductor keeps the kernel whole); called eagerly, it runs the implementation
without the dispatcher, with the op's result."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from graphrunner.models import gemv
from graphrunner.models import norm as norm_mod


def _traced_targets(fn: Any, *args: torch.Tensor) -> tuple[set[Any], Any]:
    targets: set[Any] = set()

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        targets.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets, out


def test_traced_callers_leave_their_op_and_eager_calls_equal_it() -> None:
    torch.manual_seed(0)
    x, residual, weight = torch.randn(5, 24), torch.randn(5, 24), torch.randn(24)
    w = torch.randn(7, 24)

    def layer(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        normed, summed = norm_mod.add_rms_norm(x, residual, weight, 1e-6)
        return gemv.small_m_linear(normed, w, None) + summed.sum()

    targets, traced = _traced_targets(layer, x, residual, weight, w)
    ops = {torch.ops.graphrunner.add_rms_norm, torch.ops.graphrunner.small_m_linear}  # (Dynamo keeps the packets)
    assert ops <= targets, targets
    eager = layer(x, residual, weight, w)
    via_ops = torch.ops.graphrunner.small_m_linear(
        torch.ops.graphrunner.add_rms_norm(x, residual, weight, 1e-6)[0], w, None)
    assert torch.equal(eager, traced)
    assert torch.equal(eager, via_ops + (residual + x).sum())
