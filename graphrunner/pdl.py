"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's own Triton kernels: a kernel
launched with it may start while the kernel before it in the stream finishes, and waits (`pdl_wait`) before it
touches anything that kernel wrote. On by default on Hopper and later (measured on the H200: docs/DECISIONS.md);
GRAPHRUNNER_PDL=0 turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from graphrunner.env import env_choice
from graphrunner.kernel_checks import interpreted

ENABLED = env_choice("GRAPHRUNNER_PDL", ("0", "1"), "1") == "1"
# The kernels whose programs trigger their dependents only after their own wait (`pdl_enter`), not before it:
# then the next kernel's programs can start only once the kernel before this one has ended, which bounds how many
# grids sit waiting on the SMs at once. Comma-separated names of KERNELS, or "all"; for measurements
# (docs/BENCHMARKS.md, thirty-second session).
KERNELS = ("gemv", "gate_up_act", "add_norm", "partials_add_norm", "qkv_prep", "attention", "merge")
_LATE_RAW = os.environ.get("GRAPHRUNNER_PDL_LATE_TRIGGER", "").strip().lower()
LATE_TRIGGER = frozenset(KERNELS if _LATE_RAW == "all" else (n.strip() for n in _LATE_RAW.split(",") if n.strip()))
if LATE_TRIGGER - set(KERNELS):
    raise ValueError(f"GRAPHRUNNER_PDL_LATE_TRIGGER must be 'all' or names among {', '.join(KERNELS)}; "
                     f"got {_LATE_RAW!r}")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_mode(pdl: bool, kernel: str) -> int:
    """The PDL constexpr of a launch of `kernel` (one of KERNELS): 0 without PDL, 1 to trigger the dependents before
    the wait, 2 after it (LATE_TRIGGER)."""
    return 0 if not pdl else 2 if kernel in LATE_TRIGGER else 1


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` take PDL: not switched off, and a CUDA device of compute capability 9 or
    more (the interpreter has no overlapping grids; there the kernels' PDL calls are no-ops, below)."""
    if not ENABLED or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


if interpreted():  # one program at a time, no grids to overlap: both are no-ops (Triton's interpreter lacks them)

    @triton.jit
    def pdl_wait():
        pass

    @triton.jit
    def pdl_launch_dependents():
        pass

    @triton.jit
    def pdl_enter(MODE: tl.constexpr):
        pass

else:

    @triton.jit
    def pdl_wait():
        # every write of the kernel before this one (and, through its own wait, of all earlier ones) is visible
        # after this. Before it a kernel may read only constants (weights) and what non-PDL kernels wrote (prepare's
        # step inputs, the rope table lookup): a PDL kernel starts once the kernel before it triggers, and a non-PDL
        # kernel triggers only by ending, so every non-PDL kernel earlier in the stream has ended. Every program
        # waits, so that a kernel never ends before the one it follows.
        tl.extra.cuda.gdc_wait()

    @triton.jit
    def pdl_launch_dependents():
        # the next kernel, if launched with PDL, may be scheduled once every program of this one has passed here
        tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def pdl_enter(MODE: tl.constexpr):
        # a PDL kernel's entry (MODE from pdl_mode): let the next kernel be scheduled, and wait for the one before
        if MODE == 2:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        else:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
