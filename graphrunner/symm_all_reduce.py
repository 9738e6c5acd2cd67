"""The small-message tensor-parallel all-reduce over symmetric memory (torch.distributed._symmetric_memory):
one kernel per all-reduce in which each rank reads its peers' buffers directly over NVLink. NCCL runs a protocol
that pays off for large messages, while a decode step's 8 KB all-reduces are latency-bound, so this path is for
small messages. Opt-in (GRAPHRUNNER_TP_ALLREDUCE=symm_mem) until measured against NCCL; messages larger than the
buffer and CPU tensors always go to NCCL / gloo."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphrunner.env import env_choice

logger = logging.getLogger(__name__)

ENV = "GRAPHRUNNER_TP_ALLREDUCE"
BACKENDS = ("nccl", "symm_mem")
MAX_BYTES = 2 << 20  # the buffer: a decode step of 256 tokens at hidden 4096 in bf16; prefill chunks exceed it


# torch keeps symmetric memory's per-group state (the store each group name rendezvouses through) for the life of a
# process; a second tensor-parallel engine's group reuses the name, so its rendezvous waited on the first engine's
# dead store: the second symm_mem engine in one process hung at start-up on two H200s (tenth session)
_SET_UP_IN_THIS_PROCESS = False


def check_first_engine(device: torch.device) -> None:
    """Before any rank joins: a bad GRAPHRUNNER_TP_ALLREDUCE is an error, as is symm_mem for a second
    tensor-parallel engine in this process (it would hang)."""
    if chosen_backend() == "symm_mem" and device.type == "cuda" and _SET_UP_IN_THIS_PROCESS:
        raise RuntimeError(f"{ENV}=symm_mem serves only the first tensor-parallel engine of a process (torch keeps "
                           f"symmetric memory's per-group state until the process exits, and a second engine's "
                           f"rendezvous would hang); start this engine in a new process or unset {ENV}")


def chosen_backend() -> str:
    """The all-reduce backend asked for in the environment (default nccl); a bad value is an error naming it."""
    return env_choice(ENV, BACKENDS, "nccl")


@dataclass(frozen=True)
class SymmBuffer:
    """One symmetric allocation per rank, rendezvoused over the tensor-parallel group."""

    buf: torch.Tensor  # [MAX_BYTES] uint8, symmetric
    group_name: str

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.device == self.buf.device and 0 < nbytes <= self.buf.numel() and nbytes % 4 == 0
                and x.is_contiguous())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (x must fit): x copied into the symmetric buffer, then one one-shot kernel."""
        n = x.numel()
        slot = self.buf.view(x.dtype)[:n]  # [n] at offset 0 (16-byte aligned)
        slot.copy_(x.view(-1))
        out = torch.empty_like(x)
        # the kernel's closing barrier keeps a peer from overwriting its buffer (the next all-reduce's copy) while
        # another still reads it
        torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", self.group_name, out.view(-1))
        return out


def setup(group: dist.ProcessGroup, device: torch.device) -> SymmBuffer | None:
    """The buffer, when GRAPHRUNNER_TP_ALLREDUCE=symm_mem on CUDA (collective: every rank calls this); else None."""
    if chosen_backend() != "symm_mem":
        return None
    if device.type != "cuda":
        logger.warning("%s=symm_mem is ignored on %s: symmetric memory needs CUDA devices", ENV, device)
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(MAX_BYTES, dtype=torch.uint8, device=device)
        global _SET_UP_IN_THIS_PROCESS
        _SET_UP_IN_THIS_PROCESS = True  # (before the rendezvous: a failed one leaves the state behind too)
        symm_mem.rendezvous(buf, group=group.group_name)
    except Exception as exc:  # (any failure: name the switch that asked for it)
        raise RuntimeError(f"{ENV}=symm_mem: symmetric memory could not be set up on {device} ({type(exc).__name__}: "
                           f"{exc}); unset {ENV} to use NCCL") from exc
    logger.info("tensor-parallel all-reduces of <= %d bytes use symmetric memory (one-shot)", MAX_BYTES)
    return SymmBuffer(buf, group.group_name)
