"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's own Triton kernels: a kernel
launched with it may start while the kernel before it in the stream finishes, and waits (`pdl_enter`) before it
touches anything that kernel wrote. On by default on Hopper and later (measured on the H200: docs/DECISIONS.md);
GRAPHRUNNER_PDL=0 turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from graphrunner.env import env_choice, env_number
from graphrunner.kernel_checks import interpreted

ENABLED = env_choice("GRAPHRUNNER_PDL", ("0", "1"), "1") == "1"
# Where a PDL kernel's programs trigger their dependents (`pdl_enter`): before their wait, so that the next kernel's
# programs may be placed on the SMs while this kernel still waits; or after it, so that they are placed only once the
# kernel before this one has ended, and at most one grid waits at a time. Batch-1 steps gain from the early trigger
# (tiny grids, more of each launch hidden: all kernels late cost L1 +75 us on the H200). From LATE_FROM tokens on a
# launch triggers late: there every small-M GEMV takes its tensor-core path (120-160 KB of shared memory a program,
# one a SM), and early-placed waiting grids take the SMs the running kernel's own programs need (L2 at batch 8: 0.963
# -> 0.935 ms; docs/BENCHMARKS.md, thirty-second session). Batches 2-4 (row-loop o and down projections) keep the
# early trigger until measured. GRAPHRUNNER_PDL_LATE_FROM=0 never triggers late by size; GRAPHRUNNER_PDL_LATE_TRIGGER
# names KERNELS (or "all") that trigger late at every size, for measurements.
LATE_FROM = int(env_number("GRAPHRUNNER_PDL_LATE_FROM", 5, integer=True, rule=">= 0 (tokens; 0: never)",
                           valid=lambda v: v >= 0))
KERNELS = ("gemv", "gate_up_act", "add_norm", "partials_add_norm", "qkv_prep", "attention", "merge")
_LATE_RAW = os.environ.get("GRAPHRUNNER_PDL_LATE_TRIGGER", "").strip().lower()
LATE_TRIGGER = frozenset(KERNELS if _LATE_RAW == "all" else (n.strip() for n in _LATE_RAW.split(",") if n.strip()))
if LATE_TRIGGER - set(KERNELS):
    raise ValueError(f"GRAPHRUNNER_PDL_LATE_TRIGGER must be 'all' or names among {', '.join(KERNELS)}; "
                     f"got {_LATE_RAW!r}")


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_mode(pdl: bool, kernel: str, tokens: int) -> int:
    """The PDL constexpr of a launch of `kernel` (one of KERNELS) over `tokens` rows: 0 without PDL, 1 to trigger the
    dependents before the wait, 2 after it (LATE_FROM, LATE_TRIGGER)."""
    if not pdl:
        return 0
    late = kernel in LATE_TRIGGER or (LATE_FROM > 0 and tokens >= LATE_FROM)
    return 2 if late else 1


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` take PDL: not switched off, and a CUDA device of compute capability 9 or
    more (the interpreter has no overlapping grids; there the kernels' PDL calls are no-ops, below)."""
    if not ENABLED or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


if interpreted():  # one program at a time, no grids to overlap: a no-op (Triton's interpreter lacks the calls)

    @triton.jit
    def pdl_enter(MODE: tl.constexpr):
        pass

else:

    @triton.jit
    def pdl_enter(MODE: tl.constexpr):
        # A PDL kernel's entry (MODE from pdl_mode). launch_dependents: the next kernel, if launched with PDL, may be
        # scheduled once every program of this one has passed it. wait: every write of the kernel before this one
        # (and, through its own wait, of all earlier ones) is visible after it. Before the wait a kernel may read
        # only constants (weights) and what non-PDL kernels wrote (prepare's step inputs, the rope table lookup): a
        # PDL kernel starts once the kernel before it triggers, and a non-PDL kernel triggers only by ending, so
        # every non-PDL kernel earlier in the stream has ended. Every program waits, so that a kernel never ends
        # before the one it follows.
        if MODE == 2:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        else:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
