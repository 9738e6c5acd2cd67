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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def opaque_op(name: str, fn: Callable[..., Any], mutates_args: Sequence[str] = ()) -> Any:
    """Register fn (annotated: the schema comes from its hints) as the custom op graphrunner::name; returns the op
    (for its register_fake)."""
    return torch.library.custom_op(f"graphrunner::{name}", fn, mutates_args=tuple(mutates_args))
