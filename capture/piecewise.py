"""The piecewise torch.compile backend: the model's FX graph is split at every attention custom op;
the pieces between attention calls are compiled by Inductor, attention runs eagerly between them.

This is the PIECEWISE mode's compiler half: any mix of prefill and decode can run through the
compiled pieces because attention, the only step that depends on the batch's layout, stays outside
them. Each compiled piece sits in a GraphPiece (capture/cuda_piece.py), which adds its CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.split_module import split_module

import graphrunner.attention.layer
import graphrunner.models.qkv_prep  # noqa: F401  (registers torch.ops.graphrunner.paged_attention_qkv)
from capture.cuda_piece import GraphPiece

SPLIT_OPS = (torch.ops.graphrunner.paged_attention, torch.ops.graphrunner.paged_attention.default,
             torch.ops.graphrunner.paged_attention_qkv, torch.ops.graphrunner.paged_attention_qkv.default)


def is_split_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SPLIT_OPS


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str], list[str]]:
    """Split gm into submodules: each attention call alone, everything between them grouped.

    Returns (split module, names of the compute pieces, names of the attention pieces).
    """
    partition = 0
    part_of: dict[fx.Node, int] = {}
    attention_parts: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node):
            partition += 1
            part_of[node] = partition
            attention_parts.add(partition)
            partition += 1
        else:
            part_of[node] = partition
    split = split_module(gm, None, lambda n: part_of[n], keep_original_order=True)
    compute, attention = [], []
    for name, _ in split.named_children():
        (attention if int(name.removeprefix("submod_")) in attention_parts else compute).append(name)
    return split, compute, attention


@dataclass
class PiecewiseBackend:
    """A torch.compile backend; `compile_piece` turns one compute piece into a callable (Inductor by default)."""

    compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]] | None = None
    pieces: list[str] = field(default_factory=list)           # compute pieces of the last graph compiled
    attention_pieces: list[str] = field(default_factory=list)
    graph_pieces: list[GraphPiece] = field(default_factory=list)  # of every graph compiled (one per Dynamo variant)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split, compute, attention = split_at_attention(gm)
        self.pieces, self.attention_pieces = compute, attention
        compile_piece = self.compile_piece or _inductor_piece
        # Each piece is compiled now, with example inputs found by running the split graph on fake
        # tensors (attention's fake kernel only makes the shape): Dynamo is off while compiled code
        # runs, so a piece compiled lazily at its first call would silently stay eager.
        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
                     else t for t in example_inputs]
        compiled: dict[str, Callable[..., Any]] = {}
        with fake_mode:
            _PieceCompiler(split, set(compute), compile_piece, compiled).run(*fake_args)
        for name in compute:
            piece = GraphPiece(compiled[name], name)
            self.graph_pieces.append(piece)
            setattr(split, name, piece)
        return split


class _PieceCompiler(fx.Interpreter):
    """Propagates example inputs through the split graph and compiles each compute piece on the way."""

    def __init__(self, module: fx.GraphModule, compute: set[str],
                 compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
                 out: dict[str, Callable[..., Any]]) -> None:
        super().__init__(module)
        self.compute = compute
        self.compile_piece = compile_piece
        self.out = out

    def call_module(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        result = super().call_module(target, args, kwargs)
        if target in self.compute:
            self.out[target] = self.compile_piece(self.fetch_attr(target), list(args))
        return result


def _inductor_piece(piece: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Inductor on one piece; symbolic token counts in the example inputs keep it shape-generic."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(piece, example_inputs)
