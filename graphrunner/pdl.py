"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's own Triton kernels: a kernel
launched with it may start while the kernel before it in the stream finishes, and waits (`pdl_wait`) before it
touches anything that kernel wrote. On by default on Hopper and later (measured on the H200: docs/DECISIONS.md);
GRAPHRUNNER_PDL=0 turns it off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphrunner.env import env_choice
from graphrunner.kernel_checks import interpreted

ENABLED = env_choice("GRAPHRUNNER_PDL", ("0", "1"), "1") == "1"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


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
