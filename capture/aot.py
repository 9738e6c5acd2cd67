"""Warm starts without Dynamo: the piecewise-compiled model saved whole at precompile, loaded at warm start.

`graphrunner precompile` traces the model once more through torch's AOT-compile API and writes MODEL_FILE next to
the Inductor and Triton caches: Dynamo's guards and bytecode, the traced FX graph, and every distinct compiled
piece. A warm start loads it, splits the graph at attention again and puts the pieces in place, skipping Dynamo's
trace of every layer, the pieces' cache keys and their lookups. A stale or unreadable artifact is never used: the
engine then compiles from the caches as before (capture/compiled.py).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from capture.compile_settings import configure_compilers
from capture.manifest import code_key
from capture.piecewise import PiecewiseBackend, split_at_attention

logger = logging.getLogger(__name__)

MODEL_FILE = "model.aot"
KEY_FILE = "model.aot.json"  # {"key": code_key()}: what the artifact was traced from
def available() -> bool:
    """Whether this torch has the AOT-compile API (torch.compile(...).aot_compile and load_compiled_function), and
    GRAPHRUNNER_AOT is not 0."""
    return (os.environ.get("GRAPHRUNNER_AOT", "1") != "0" and hasattr(torch.compiler, "load_compiled_function")
            and hasattr(torch._dynamo.config, "enable_aot_compile") and _serializable_base() is not None)


def _serializable_base() -> type | None:
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:
        try:  # torch 2.11 keeps it beside the API
            from torch._dynamo.aot_compile import SerializableCallable  # type: ignore[no-redef]
        except ImportError:
            return None
    return SerializableCallable


def _dumps_graph(obj: Any) -> bytes:
    """torch's GraphPickler (fake-tensor metadata and symbolic sizes included), with sympy functions by name and no
    fake mode, as vLLM's compile cache pickles graphs."""
    import sympy
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler, Options

    base = GraphPickler.reducer_override

    def reducer_override(self: Any, o: Any) -> Any:
        if inspect.isclass(o) and issubclass(o, sympy.Function) and hasattr(o, "_torch_unpickler"):
            return o._torch_unpickler, (o._torch_handler_name,)
        if isinstance(o, FakeTensorMode):
            return type(None), ()
        return base(self, o)

    with patch.object(GraphPickler, "reducer_override", reducer_override):
        return GraphPickler.dumps(obj, Options(ops_filter=None))


def _unflattening(fn: Callable[..., Any], spec: Any) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        return pytree.tree_unflatten(fn(*args), spec)
    return wrapper


_SERIALIZABLE: Any = _serializable_base() or object  # (without the API nothing is saved or loaded: available())


class PiecewiseArtifact(_SERIALIZABLE):  # type: ignore[misc,valid-type]
    """What the piecewise backend made of one Dynamo graph, in a form torch saves beside the guards (a
    SerializableCallable): the graph and its distinct compiled pieces."""

    def __init__(self, graph_module: fx.GraphModule, piece_fns: dict[str, Callable[..., Any]],
                 backend: PiecewiseBackend | None = None, runnable: Any = None) -> None:
        self.graph_module = graph_module  # the whole traced graph (re-split on load)
        self.piece_fns = piece_fns        # compute piece name -> compiled callable (equal pieces share one)
        self.backend = backend or PiecewiseBackend()
        self.runnable = runnable          # the split module whose compute pieces are GraphPieces

    def __call__(self, *args: Any) -> Any:
        return self.runnable(*args)

    def rebuild(self) -> None:
        """After loading: split the graph at attention again and put each compiled piece in a GraphPiece, listed in
        the backend (which the capture manager records graphs for)."""
        split, compute, attention = split_at_attention(self.graph_module)
        self.backend.pieces, self.backend.attention_pieces = compute, attention
        wrapped: dict[int, Callable[..., Any]] = {}
        fns: dict[str, Callable[..., Any]] = {}
        for name in compute:
            fn = self.piece_fns[name]
            (out,) = next(n for n in getattr(split, name).graph.nodes if n.op == "output").args
            if not isinstance(out, (tuple, list)):
                # compile_fx compiled this piece as returning a tuple and unwrapped it in a wrapper that the saved
                # entry lacks: re-nest its outputs as the split graph expects
                fn = wrapped.setdefault(id(fn), _unflattening(fn, pytree.tree_flatten(out)[1]))
            fns[name] = fn
        self.backend.install(split, compute, fns)
        self.runnable = split

    @classmethod
    def serialize_compile_artifacts(cls, fn: PiecewiseArtifact) -> bytes:
        gm = fn.graph_module
        for node in gm.graph.nodes:  # module paths and source stacks: not needed to split or run the graph
            node.meta.pop("source_fn_stack", None)
            node.meta.pop("nn_module_stack", None)
        pieces: dict[str, bytes] = {}
        first: dict[int, str] = {}
        names: dict[str, str] = {}
        with torch._functorch.config.patch("bundled_autograd_cache", True):
            for name, f in fn.piece_fns.items():
                if id(f) not in first:
                    first[id(f)] = name
                    pieces[name] = pickle.dumps(f.serialize())  # type: ignore[attr-defined]
                names[name] = first[id(f)]
        return pickle.dumps({"gm": _dumps_graph(gm), "pieces": pieces, "names": names})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PiecewiseArtifact:
        from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = pickle.loads(data)
        gm = GraphPickler.loads(state["gm"], FakeTensorMode(shape_env=ShapeEnv()))
        loaded = {n: deserialize_bundled_cache_entry(pickle.loads(b)) for n, b in state["pieces"].items()}
        artifact = cls(gm, {n: loaded[src] for n, src in state["names"].items()})
        artifact.rebuild()
        return artifact


class _SavingBackend:
    """The piecewise backend whose output torch can save: a PiecewiseArtifact around the split module."""

    def __init__(self) -> None:
        self.inner = PiecewiseBackend()

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        split = self.inner(gm, example_inputs)
        fns = {name: getattr(split, name).fn for name in self.inner.pieces}
        return PiecewiseArtifact(gm, fns, self.inner, split)


class AOTCompiledModel(nn.Module):
    """Stands where torch.compile's module stood: calls the loaded forward with the model first (the traced
    function is type(model).forward); every other attribute is the model's.

    The saved guards are checked at every call, and a failure raises instead of tracing. The first call (a warm-up
    or the memory profile's step, before any graph is captured) is where a run that differs from precompile's in
    global state (CPU threads, say) meets them: there the model is traced again through the same backend, whose
    piece list the capture manager already holds."""

    def __init__(self, model: nn.Module, compiled: Callable[..., Any], backend: PiecewiseBackend,
                 retrace: Callable[[], nn.Module]) -> None:
        super().__init__()
        self._orig_mod = model
        self._compiled = compiled
        self._backend = backend
        self._retrace: Callable[[], nn.Module] | None = retrace
        self.retraced = False  # the saved compilation was refused at the first call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._retrace is None:
            return self._compiled(self._orig_mod, *args, **kwargs)
        retrace, self._retrace = self._retrace, None
        try:
            return self._compiled(self._orig_mod, *args, **kwargs)
        except RuntimeError as exc:
            if "GuardManager check failed" not in str(exc):
                raise
            logger.warning("the saved compilation's guards refused this run (%s); tracing again",
                           str(exc).splitlines()[0][:300])
        self._backend.graph_pieces.clear()  # (in place: the capture manager holds this list)
        traced = retrace()
        self._compiled = lambda _model, *a, **k: traced(*a, **k)
        self.retraced = True
        return self._compiled(self._orig_mod, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def save(model: nn.Module, example_args: tuple[Any, ...], cache_dir: Path) -> None:
    """Trace type(model).forward(model, *example_args) through the piecewise backend (its pieces come from the
    caches cache_dir already holds) and write MODEL_FILE and KEY_FILE there. Call it with the forward's context set
    and in inference mode, as the engine's steps run (both are guarded)."""
    configure_compilers()
    torch._dynamo.config.enable_aot_compile = True  # torch 2.11's default is off, and .aot_compile is then absent
    compiled = torch.compile(type(model).forward, backend=_SavingBackend(), fullgraph=True, dynamic=True)
    aot = compiled.aot_compile(((model, *example_args), {}))  # type: ignore[attr-defined]
    aot.save_compiled_function(str(cache_dir / MODEL_FILE))
    (cache_dir / KEY_FILE).write_text(json.dumps({"key": code_key()}))


def load(cache_dir: Path, model: nn.Module, retrace: Callable[[PiecewiseBackend], nn.Module]
         ) -> tuple[nn.Module, PiecewiseBackend] | None:
    """The model with its saved compilation (and the backend listing its pieces), or None where cache_dir has no
    artifact, it was traced from other code or switches, or it does not load (each logged): compile as usual.
    retrace(backend) compiles the model through that backend, for a run the saved guards refuse."""
    path = cache_dir / MODEL_FILE
    if not available() or not path.is_file():
        return None
    try:
        key = json.loads((cache_dir / KEY_FILE).read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        key = None
    if key != code_key():
        logger.info("compile cache %s: %s was traced from other code or GRAPHRUNNER_* switches; tracing again",
                    cache_dir, MODEL_FILE)
        return None
    configure_compilers()
    torch._dynamo.config.enable_aot_compile = True
    try:
        with open(path, "rb") as f, torch.inference_mode():  # guards are rebuilt against the engine's grad mode
            compiled = torch.compiler.load_compiled_function(f, f_globals=type(model).forward.__globals__)
        artifact = compiled._artifacts.compiled_fn
        backend = artifact.backend if isinstance(artifact, PiecewiseArtifact) else None
    except Exception as exc:  # noqa: BLE001 - any failure to load means: trace as before
        logger.warning("compile cache %s: %s did not load (%s: %s); tracing again", cache_dir, MODEL_FILE,
                       type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    if backend is None:
        logger.warning("compile cache %s: %s holds no piecewise compilation; tracing again", cache_dir, MODEL_FILE)
        return None
    return AOTCompiledModel(model, compiled, backend, lambda: retrace(backend)), backend
