"""Opaque ops: the kernels torch.compile must keep whole (attention, the small-M GEMV, the fused norms,
collectives) are registered as custom ops graphrunner::NAME, and each has a plain caller that calls the op while
Dynamo traces and the implementation itself otherwise:

    def add_rms_norm(x, ...):
        if torch.compiler.is_compiling():
            return torch.ops.graphrunner.add_rms_norm(x, ...)   # one opaque node in the traced graph
        return _add_rms_norm(x, ...)                              # eager: the function, no dispatcher

Why not call the op everywhere: torch.library.custom_op wraps every implementation in a Dynamo guard that imports
torch._dynamo (and sympy) at the op's first call, 2-3 s of an uncompiled engine's start-up that it never uses, and
every dispatch costs host time (5-10 µs a call on the H200's host, in eager steps and graph warm-ups).

A trace for a compiler that does not fuse (the piecewise backend's "eager" pieces) takes the eager forms of the
few ops whose traced form is plain PyTorch for Inductor to fuse (`fusing_trace`), and its pieces call the
implementations registered here (`implementation`), so they run without the dispatcher, or Dynamo, too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

_IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}  # op name (graphrunner::NAME) -> its implementation
_FUSING_TRACE = True  # False while a model is traced for the eager piece compiler (trace_without_fusion)


def opaque_op(name: str, fn: Callable[..., Any], mutates_args: Sequence[str] = ()) -> Any:
    """Register fn (annotated: the schema comes from its hints) as the custom op graphrunner::name; returns the op
    (for its register_fake)."""
    _IMPLEMENTATIONS[f"graphrunner::{name}"] = fn
    return torch.library.custom_op(f"graphrunner::{name}", fn, mutates_args=tuple(mutates_args))


def implementation(target: Any) -> Callable[..., Any] | None:
    """The function behind a graphrunner op (an OpOverload or its packet, as a traced graph's node holds it), or
    None for any other target."""
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "_qualified_op_name", None)
    return _IMPLEMENTATIONS.get(name) if isinstance(name, str) else None


def fusing_trace() -> bool:
    """Whether the code runs inside a trace whose pieces Inductor compiles: there a few ops take their plain PyTorch
    form, which Inductor fuses with its neighbours, instead of a Triton launch of ours."""
    return torch.compiler.is_compiling() and _FUSING_TRACE


@contextmanager
def trace_without_fusion() -> Iterator[None]:
    """Calls in this block that Dynamo traces take every op's eager form (the eager piece compiler's traces)."""
    global _FUSING_TRACE
    previous, _FUSING_TRACE = _FUSING_TRACE, False
    try:
        yield
    finally:
        _FUSING_TRACE = previous
