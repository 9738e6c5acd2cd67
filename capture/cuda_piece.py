"""CUDA graphs for the compiled pieces (PIECEWISE mode): one graph per (piece, token count), all in
one shared memory pool, captured while the capture manager runs dummy forwards largest-first.

A piece replays only inside `piecewise_graphs(size)`; elsewhere (eager steps, warm-up, the inside
of a FULL graph's capture) it runs its compiled code directly.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.utils._pytree import tree_map


@dataclass
class _Mode:
    size: int           # the padded token count of this forward
    capture: bool       # capture a graph for pieces that have none at this size
    pool: Any           # torch.cuda graph pool handle shared by every graph


_MODE: _Mode | None = None


@contextmanager
def piecewise_graphs(size: int, pool: Any, capture: bool = False) -> Iterator[None]:
    """Pieces called in this block replay their graph for `size` (capturing one first if `capture`)."""
    global _MODE
    previous, _MODE = _MODE, _Mode(size, capture, pool)
    try:
        yield
    finally:
        _MODE = previous


@contextmanager
def fast_capture() -> Iterator[None]:
    """torch.cuda.graph runs gc.collect() and empty_cache() on every capture: thousands of piece
    captures would spend most of their time there, and nothing in between needs them."""
    with ExitStack() as stack:
        stack.enter_context(mock.patch("gc.collect", lambda *a, **k: 0))
        stack.enter_context(mock.patch("torch.cuda.empty_cache", lambda: None))
        yield
    gc.collect()


def weak_alias(t: Any) -> Any:
    """A tensor viewing t's memory without owning it, so the pool can hand that memory to the next
    (smaller) capture; safe because graphs of different sizes never run at the same time."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        return t
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.size(), t.stride())


def _is_buffer(a: Any) -> bool:
    """A tensor a graph reads by address. Host scalars are not: a graph holds their values, captured
    as kernel arguments (unspecialised float attributes would arrive as 0-d CPU tensors)."""
    return isinstance(a, torch.Tensor) and (a.dim() > 0 or a.device.type != "cpu")


def _tensor_ptrs(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(a.data_ptr() for a in args if _is_buffer(a))


def _record(fn: Callable[..., Any], args: tuple[Any, ...], pool: Any) -> tuple[Any, Any]:
    """Capture fn(*args) as a CUDA graph in `pool`; returns (graph, what fn returned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    input_ptrs: tuple[int, ...]
    outputs: Any  # weak aliases of what the piece returned at capture


class GraphPiece(torch.nn.Module):
    """Holds one compiled piece where split_module expects a submodule, plus its graphs by size."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        super().__init__()
        self.fn = fn
        self.name = name
        self.graphs: dict[int, _Captured] = {}
        self.moved_input_calls = 0  # replays refused because an input was not where it was at capture
        self.uncaptured_calls = 0   # calls in piecewise mode at a size this piece has no graph for

    def forward(self, *args: Any) -> Any:
        mode = _MODE
        if mode is None:
            return self.fn(*args)
        entry = self.graphs.get(mode.size)
        if entry is None:
            if not mode.capture:
                # e.g. a Dynamo variant compiled after capture: correct, but no graph to replay
                self.uncaptured_calls += 1
                return self.fn(*args)
            return self._capture(mode, args)
        ptrs = _tensor_ptrs(args)
        if ptrs != entry.input_ptrs:
            # Inputs come from the previous piece's graph, the attention buffers it allocated, the
            # runner's step buffers or the weights: a moved one means the graph would read stale
            # memory, so this call runs the compiled code on the real inputs instead (correct, slower).
            self.moved_input_calls += 1
            if self.moved_input_calls == 1:
                tensors = [a for a in args if _is_buffer(a)]
                moved = [(i, tuple(tensors[i].shape), str(tensors[i].dtype)) for i, (a, b)
                         in enumerate(zip(ptrs, entry.input_ptrs)) if a != b]
                print(f"graphrunner: piece {self.name} at size {mode.size}: inputs moved since capture {moved}; "
                      f"running it without its graph", file=sys.stderr)
            return self.fn(*args)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, mode: _Mode, args: tuple[Any, ...]) -> Any:
        graph, out = _record(self.fn, args, mode.pool)
        self.graphs[mode.size] = _Captured(graph, _tensor_ptrs(args), tree_map(weak_alias, out))
        return out  # strong references until this capture forward ends: later pieces must not reuse it
