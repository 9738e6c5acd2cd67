"""The piecewise torch.compile backend: the model's FX graph is split at every attention custom op;
the pieces between attention calls are compiled by Inductor (or, with the "eager" piece compiler, run as traced:
each graphrunner op node calls its implementation), attention runs eagerly between them.

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
from graphrunner.config import COMPILE_BACKENDS
from graphrunner.opaque import implementation

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
    reuse: bool = True  # a piece equal to an earlier one (piece_key) takes its compiled code instead of compiling
    compiled_pieces: int = 0  # distinct compiled callables in the last graph (tests and start-up logs read it)

    @classmethod
    def named(cls, compiler: str) -> PiecewiseBackend:
        """The backend whose pieces the named piece compiler (config.COMPILE_BACKENDS) makes."""
        if compiler not in COMPILE_BACKENDS:
            raise ValueError(f"piece compiler must be one of {COMPILE_BACKENDS}, got {compiler!r}")
        return cls(eager_piece if compiler == "eager" else None)

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
            _PieceCompiler(split, set(compute), compile_piece, compiled, self.reuse).run(*fake_args)
        if compile_piece is eager_piece:  # attention too, then (after the fake run): its op without the dispatcher
            for name in attention:
                call_implementations(getattr(split, name))
        self.install(split, compute, compiled)
        return split

    def install(self, split: fx.GraphModule, compute: list[str], compiled: dict[str, Callable[..., Any]]) -> None:
        """Put each compute piece's compiled callable into the split graph inside a GraphPiece, listed here for the
        capture manager (which records graphs per piece); also used by a warm start's loaded compilation."""
        self.compiled_pieces = len(set(map(id, compiled.values())))
        for name in compute:
            piece = GraphPiece(compiled[name], name)
            self.graph_pieces.append(piece)
            setattr(split, name, piece)


class _PieceCompiler(fx.Interpreter):
    """Propagates example inputs through the split graph and compiles each compute piece on the way."""

    def __init__(self, module: fx.GraphModule, compute: set[str],
                 compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
                 out: dict[str, Callable[..., Any]], reuse: bool = True) -> None:
        super().__init__(module)
        self.compute = compute
        self.compile_piece = compile_piece
        self.out = out
        self.reuse = reuse
        self.by_key: dict[str, Callable[..., Any]] = {}

    def call_module(self, target: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        result = super().call_module(target, args, kwargs)
        if target in self.compute:
            piece = self.fetch_attr(target)
            key = piece_key(piece, list(args)) if self.reuse else None
            if key is None or key not in self.by_key:
                compiled = self.compile_piece(piece, list(args))
                if key is not None:
                    self.by_key[key] = compiled
            self.out[target] = self.by_key[key] if key is not None else compiled
        return result


def piece_key(piece: fx.GraphModule, example_inputs: list[Any]) -> str | None:
    """What a piece computes, independent of its node and input names: its nodes in order (op, target, arguments
    as node indices and constants) and its inputs' metadata (shape, stride, dtype, device, symbolic sizes as
    written). Equal keys compile to interchangeable code: the decoder's middle layers are one piece 26 times over,
    with only their weights' names changed. None (compile it alone) for a piece that reads module attributes
    (get_attr, call_module) or holds a tensor constant, whose values the key cannot see."""
    index: dict[fx.Node, int] = {}
    parts: list[str] = []

    class _Unkeyable(Exception):
        pass

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"%{index[a]}"
        if isinstance(a, torch.Tensor):  # a tensor constant: its repr does not show all its values
            raise _Unkeyable
        if isinstance(a, (tuple, list)):
            inner = ",".join(arg(x) for x in a)
            return f"{type(a).__name__}({inner})"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k!r}:{arg(v)}" for k, v in a.items()) + "}"
        return f"{type(a).__name__}:{a!r}"

    for i, node in enumerate(piece.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        target = node.target if isinstance(node.target, str) else f"{node.target!r}@{id(node.target)}"
        try:
            parts.append(f"{node.op} {target if node.op != 'placeholder' else ''} {arg(node.args)} {arg(node.kwargs)}")
        except _Unkeyable:
            return None
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"T{tuple(map(str, x.shape))}{tuple(map(str, x.stride()))}{x.dtype}{x.device}"
                         f"{x.requires_grad}{type(x).__name__}")
        else:
            parts.append(arg(x))
    return "\n".join(parts)


def _inductor_piece(piece: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Inductor on one piece; symbolic token counts in the example inputs keep it shape-generic."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(piece, example_inputs)


def eager_piece(piece: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The piece as Dynamo traced it, its graphrunner op nodes calling their implementations: no Inductor at
    compile or load time. The decode step's kernels are ours either way; what Inductor would fuse is traced in
    its eager form here (opaque.trace_without_fusion)."""
    return call_implementations(piece)


def call_implementations(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with every graphrunner op node calling the op's implementation (opaque.implementation), recompiled in
    place: eager calls skip the dispatcher and custom_op's Dynamo guard."""
    for node in gm.graph.nodes:
        fn = implementation(node.target) if node.op == "call_function" else None
        if fn is not None:
            node.target = fn
    gm.recompile()
    return gm
