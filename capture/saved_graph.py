"""Warm starts without Dynamo or Inductor, for the "eager" piece compiler: the traced graph, split at attention, is
saved at precompile as data (nodes with named targets) and rebuilt at warm start as FX modules.

An eager compile's pieces are the traced FX code itself, so a warm start needs no compiler: it rebuilds the split
graph, binds its inputs (the model's weights, the forward's arguments and their sizes) and puts each compute piece
in a GraphPiece, as the backend would. A file traced from other code or switches (manifest.code_key), or one that
does not load, is never used: the engine then traces as before.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

import graphrunner.attention.layer
import graphrunner.models.qkv_prep  # noqa: F401  (register the attention ops the saved graph names)
from capture.cuda_piece import GraphPiece
from capture.manifest import code_key
from graphrunner.opaque import implementation

logger = logging.getLogger(__name__)

GRAPH_FILE = "model.graph"
_FORMAT = 1
_ARGS = ("input_ids", "positions")  # the forward's tensor arguments a saved graph may read
_OP = "graphrunner::"  # a target naming one of our ops: rebuilt as a call of its implementation


@dataclass(frozen=True)
class Ref:
    """A node's argument that is another node's value (by the node's name)."""

    name: str


@dataclass(frozen=True)
class Binding:
    """Where one input of the traced graph comes from: a model tensor ("state", its path), a forward argument
    ("arg", its name) or one of an argument's sizes ("size", its name and dim)."""

    kind: str
    name: str
    dim: int = 0


@dataclass
class SavedPieces:
    """What lists a loaded graph's compute pieces for the capture manager (as PiecewiseBackend does)."""

    graph_pieces: list[GraphPiece]
    compiled_pieces: int


class Unsaveable(Exception):
    """The traced graph holds something this format cannot name (a tensor constant, a local function, ...)."""


# ---- save ---------------------------------------------------------------------------------------------------------

def _target_name(target: Any) -> str:
    fn = implementation(target)
    if fn is not None:
        return target.name() if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name
    try:
        name = fx.node._get_qualified_name(target)
        resolved = _resolve(name)
    except Exception:  # noqa: BLE001 - anything it cannot name and find again, this format cannot hold
        resolved = name = None
    if name is None or resolved is not target:
        raise Unsaveable(f"target {target!r} does not resolve back from {name!r}")
    return name


_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout,
              type(Ellipsis))


def _arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return Ref(a.name)
    if isinstance(a, (tuple, list)):  # (fx's immutable_list becomes a list)
        return tuple(_arg(x) for x in a) if isinstance(a, tuple) else [_arg(x) for x in a]
    if isinstance(a, dict):
        return {k: _arg(v) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_arg(a.start), _arg(a.stop), _arg(a.step))
    if isinstance(a, _CONSTANTS):
        return a
    raise Unsaveable(f"argument {type(a).__name__} {a!r:.80}")


def graph_nodes(gm: fx.GraphModule) -> list[tuple[str, str, Any, Any, Any]]:
    """gm's nodes as (op, name, target, args, kwargs): call_function targets by name, arguments with Refs."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            raise Unsaveable(f"node {node.name} reads the module attribute {node.target!r}")
        target = _target_name(node.target) if node.op == "call_function" else node.target
        out.append((node.op, node.name, target, _arg(node.args), _arg(node.kwargs)))
    return out


def _source_name(node: fx.Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    if not isinstance(name, str):
        raise Unsaveable(f"input {node.name} has no source")
    return name


def bindings(gm: fx.GraphModule, example_inputs: list[Any], model: nn.Module) -> list[Binding]:
    """Where each of Dynamo's graph inputs comes from (its example inputs are the real tensors and sizes)."""
    state = {id(t): path for path, t in (*model.named_parameters(remove_duplicate=False),
                                         *model.named_buffers(remove_duplicate=False))}
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise Unsaveable(f"{len(placeholders)} graph inputs, {len(example_inputs)} example inputs")
    for node, example in zip(placeholders, example_inputs, strict=True):
        if isinstance(example, torch.Tensor) and id(example) in state:
            out.append(Binding("state", state[id(example)]))
            continue
        name = _source_name(node)
        for arg in _ARGS:
            if isinstance(example, torch.Tensor) and name == f"L['{arg}']":
                out.append(Binding("arg", arg))
                break
            if not isinstance(example, torch.Tensor) and name.startswith(f"L['{arg}'].size()["):
                out.append(Binding("size", arg, int(name.removeprefix(f"L['{arg}'].size()[").removesuffix("]"))))
                break
        else:
            raise Unsaveable(f"input {node.name} comes from {name}")
    return out


def serialize(gm: fx.GraphModule, example_inputs: list[Any], model: nn.Module) -> bytes:
    """What load() rebuilds: Dynamo's graph of model.forward split at attention, with its input bindings (raises
    Unsaveable for a graph this format cannot hold)."""
    from capture.piecewise import split_at_attention

    out = next(n for n in gm.graph.nodes if n.op == "output")
    if not (isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1):
        raise Unsaveable(f"the graph returns {out.args[0]!r:.80}, not one tensor")
    split, compute, attention = split_at_attention(gm)
    return pickle.dumps({
        "format": _FORMAT, "key": code_key(), "bindings": bindings(gm, example_inputs, model),
        "top": graph_nodes(split), "compute": compute, "attention": attention,
        "submodules": {name: graph_nodes(getattr(split, name)) for name in (*compute, *attention)},
    })


class _Recorder:
    """A torch.compile backend that only records: the serialized graph (or why there is none), then runs it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.data: bytes | None = None
        self.why = "nothing was traced"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        try:
            self.data = serialize(gm, example_inputs, self.model)
        except Unsaveable as exc:
            self.why = str(exc)
        return gm.forward


def save(model: nn.Module, example_args: tuple[Any, ...], cache_dir: Path) -> bool:
    """Trace model(*example_args) as an eager-pieces engine does and write GRAPH_FILE; False (logged, nothing
    written) for a graph this format cannot hold. Call it with the forward's context set and in inference mode."""
    from capture.compile_settings import configure_compilers
    from graphrunner.opaque import trace_without_fusion

    configure_compilers()
    recorder = _Recorder(model)
    with trace_without_fusion():
        torch.compile(model, backend=recorder, fullgraph=True, dynamic=True)(*example_args)
    if recorder.data is None:
        logger.warning("the traced graph cannot be saved for a warm start without Dynamo (%s); warm starts will "
                       "trace it", recorder.why)
        return False
    (cache_dir / GRAPH_FILE).write_bytes(recorder.data)
    return True


# ---- load ---------------------------------------------------------------------------------------------------------

def _resolve(name: str) -> Any:
    """The object a qualified name (fx's _get_qualified_name) names: the longest importable module prefix, then
    attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"cannot resolve {name!r}")


def _callable(name: str) -> Any:
    if not name.startswith(_OP):
        return _resolve(name)
    fn = implementation(getattr(torch.ops.graphrunner, name.removeprefix(_OP)).default)
    if fn is None:
        raise ValueError(f"no implementation registered for {name}")
    return fn


def _rebuild(nodes: list[tuple[str, str, Any, Any, Any]], modules: dict[str, nn.Module]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def value(a: Any) -> Any:
        if isinstance(a, Ref):
            return env[a.name]
        if isinstance(a, tuple):
            return tuple(value(x) for x in a)
        if isinstance(a, list):
            return [value(x) for x in a]
        if isinstance(a, dict):
            return {k: value(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(value(a.start), value(a.stop), value(a.step))
        return a

    for op, name, target, args, kwargs in nodes:
        if op == "call_function":
            target = _callable(target)
        env[name] = graph.create_node(op, target, value(args), value(kwargs), name=name)
    return fx.GraphModule(modules, graph)


class SavedGraphModel(nn.Module):
    """Stands where the compiled model stood: model(input_ids, positions) through the rebuilt split graph; every
    other attribute is the model's."""

    def __init__(self, model: nn.Module, runnable: fx.GraphModule, binds: list[Binding]) -> None:
        super().__init__()
        self._orig_mod = model
        self._runnable = runnable
        tensors = dict((*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)))
        missing = [b.name for b in binds if b.kind == "state" and b.name not in tensors]
        if missing:
            raise ValueError(f"the model has no tensors {missing[:3]}")
        self._binds = [(b, tensors.get(b.name)) for b in binds]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError("the saved graph was traced from input_ids: it cannot take inputs_embeds")
        args = {"input_ids": input_ids, "positions": positions}
        flat = [t if b.kind == "state" else args[b.name] if b.kind == "arg" else args[b.name].shape[b.dim]
                for b, t in self._binds]
        (out,) = self._runnable(*flat)
        return out

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def load(cache_dir: Path, model: nn.Module) -> tuple[SavedGraphModel, SavedPieces] | None:
    """The model behind its saved split graph, and its compute pieces, or None where cache_dir has no GRAPH_FILE,
    it was traced from other code or switches, or it does not load (each logged): trace as usual."""
    path = cache_dir / GRAPH_FILE
    if not path.is_file() or os.environ.get("GRAPHRUNNER_AOT", "1") == "0":  # (as for model.aot: trace again)
        return None
    try:
        state = pickle.loads(path.read_bytes())
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError("not a saved graph of this format")
    except Exception as exc:  # noqa: BLE001 - any failure to read means: trace as before
        logger.warning("compile cache %s: %s is unreadable (%s); tracing again", cache_dir, GRAPH_FILE, exc)
        return None
    if state["key"] != code_key():
        logger.info("compile cache %s: %s was traced from other code or GRAPHRUNNER_* switches; tracing again",
                    cache_dir, GRAPH_FILE)
        return None
    try:
        modules: dict[str, nn.Module] = {}
        pieces = []
        for name in state["compute"]:
            pieces.append(GraphPiece(_rebuild(state["submodules"][name], {}), name))
            modules[name] = pieces[-1]
        for name in state["attention"]:
            modules[name] = _rebuild(state["submodules"][name], {})
        saved = SavedGraphModel(model, _rebuild(state["top"], modules), state["bindings"])
    except Exception as exc:  # noqa: BLE001
        logger.warning("compile cache %s: %s did not load (%s: %s); tracing again", cache_dir, GRAPH_FILE,
                       type(exc).__name__, exc)
        return None
    return saved, SavedPieces(pieces, len(pieces))
