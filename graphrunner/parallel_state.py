"""Tensor-parallel state of this process (rank, world size, process groups) and the collectives models call.

One process per rank; the front initialises the groups once (`init_tensor_parallel`) before the model is built,
and model layers read `tp_rank()` / `tp_size()` when they are constructed. The collectives are custom ops, so
torch.compile keeps them as single opaque nodes (no host-side work is traced) and CUDA graphs capture them.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphrunner.config import ModelConfig
from graphrunner.opaque import opaque_op
from graphrunner.symm_all_reduce import SymmBuffer, check_first_engine
from graphrunner.symm_all_reduce import setup as setup_symm_all_reduce


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.world_size})")


_STATE = TPState()
_DEVICE_GROUP: dist.ProcessGroup | None = None  # NCCL on GPU, gloo on CPU: the model's collectives
_CPU_GROUP: dist.ProcessGroup | None = None     # gloo: host-side agreement (KV block count)
_SYMM: SymmBuffer | None = None                 # small all-reduces over symmetric memory (opt-in)


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.world_size


def init_tensor_parallel(rank: int, world_size: int, store: dist.Store, device: torch.device,
                         timeout_s: float) -> None:
    """Join the process group (rendezvous through `store`) and make this process rank `rank` of `world_size`."""
    global _STATE, _DEVICE_GROUP, _CPU_GROUP, _SYMM
    if _STATE.world_size != 1 or dist.is_initialized():
        raise RuntimeError("tensor parallelism is already initialised in this process (one engine per process; or an "
                           "earlier engine's group could not be left: see stderr)")
    state = TPState(rank, world_size)
    check_first_engine(device)  # (a bad GRAPHRUNNER_TP_ALLREDUCE, or symm_mem a second time, fails before any rank joins)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    _DEVICE_GROUP = dist.group.WORLD
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _SYMM = setup_symm_all_reduce(_DEVICE_GROUP, device)
    _STATE = state


TEARDOWN_TIMEOUT_S = 30.0  # leaving the group waits at most this long: a stuck peer must not hang a shutdown
_TEARDOWN_LOCK = threading.Lock()  # the watcher's abort and the owner's destroy never run at once


def destroy_tensor_parallel(timeout_s: float = TEARDOWN_TIMEOUT_S) -> bool:
    """Leave the process group (a later engine in this process may initialise again); True once it is left.

    On GPU, drop every CUDA graph that captured a collective first: NCCL does not free a communicator while a live
    graph holds collectives of it, so destroying (or aborting) it would wait for good. Destroying is collective in
    recent NCCL: every rank leaves at about the same time. Bounded by `timeout_s` (a message says so on stderr)."""
    return _leave(graceful=True, timeout_s=timeout_s)


def abort_tensor_parallel(timeout_s: float = TEARDOWN_TIMEOUT_S) -> bool:
    """Best effort: abort the communicators so that a collective waiting on a dead peer returns (with an error);
    needs no peer. Bounded by `timeout_s`; True once done."""
    return _leave(graceful=False, timeout_s=timeout_s)


def _leave(graceful: bool, timeout_s: float) -> bool:
    global _STATE, _DEVICE_GROUP, _CPU_GROUP, _SYMM
    what = "leaving" if graceful else "aborting"
    if not _TEARDOWN_LOCK.acquire(timeout=timeout_s):
        print(f"graphrunner: {what} the tensor-parallel group: an earlier teardown still runs after "
              f"{timeout_s:.0f} s", file=sys.stderr)
        return False
    _STATE, _DEVICE_GROUP, _CPU_GROUP, _SYMM = TPState(), None, None, None
    if not (dist.is_available() and dist.is_initialized()):
        _TEARDOWN_LOCK.release()
        return True
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    call = dist.destroy_process_group if graceful or abort is None else abort
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 -- e.g. after an abort: the group is gone either way
            errors.append(exc)
        finally:
            _TEARDOWN_LOCK.release()  # (held until the teardown really ends: none runs beside a stuck one)

    # in a daemon thread: NCCL's destroy can block for good (a peer gone, a graph still holding the communicator)
    thread = threading.Thread(target=run, name=f"graphrunner-tp-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        print(f"graphrunner: {what} the tensor-parallel group did not finish within {timeout_s:.1f} s (a peer gone, "
              f"or a CUDA graph still holding the communicator); a later engine in this process cannot start "
              f"tensor parallelism", file=sys.stderr)
        return False
    if errors:
        print(f"graphrunner: {what} the tensor-parallel group: {errors[0]}", file=sys.stderr)
    return True


def min_across_ranks(value: int) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory allows); host-side, gloo."""
    if _STATE.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t[0])


def check_same_across_ranks(value: int, what: str) -> None:
    """Raise a clear error unless every rank has the same `value` (e.g. a digest of the graphs it will capture):
    ranks that would run different collectives deadlock instead. Host-side, gloo."""
    if _STATE.world_size == 1:
        return
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    if int(t[0]) != -int(t[1]):
        raise RuntimeError(f"tensor-parallel ranks disagree on {what} (rank {_STATE.rank} has {value}); their "
                           f"collectives would not match")


# ---- sharding arithmetic -------------------------------------------------------------------------

def shard_range(total: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """[start, start + size) of an even split of `total` (which must divide by the world size)."""
    rank, world = (tp_rank() if rank is None else rank), (tp_size() if world is None else world)
    if total % world:
        raise ValueError(f"{total} does not split evenly over tensor_parallel_size={world}")
    size = total // world
    return rank * size, size


def kv_head_range(num_kv_heads: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(first KV head, count) this rank holds: an even split, or one replicated head when there are fewer KV
    heads than ranks (ranks r * Hkv // world share head ... as vLLM does)."""
    rank, world = (tp_rank() if rank is None else rank), (tp_size() if world is None else world)
    if num_kv_heads >= world:
        return shard_range(num_kv_heads, rank, world)
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world} must be a multiple of num_kv_heads={num_kv_heads} "
                         f"when it exceeds it")
    return rank // (world // num_kv_heads), 1


def vocab_range(vocab_size: int, rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(first id, rows per rank) of the vocab-parallel split; the last rank's rows past the vocabulary are padding."""
    rank, world = (tp_rank() if rank is None else rank), (tp_size() if world is None else world)
    per_rank = -(-vocab_size // world)
    return rank * per_rank, per_rank


def rank_kv_config(model: ModelConfig) -> ModelConfig:
    """`model` with this rank's attention heads, for sizing its KV cache (the cache holds only its KV heads)."""
    if _STATE.world_size == 1:
        return model
    _, kv_heads = kv_head_range(model.num_kv_heads)
    return dataclasses.replace(model, num_heads=model.num_heads // _STATE.world_size, num_kv_heads=kv_heads)


# ---- collectives (opaque ops, graphrunner/opaque.py: opaque to torch.compile, capturable in CUDA graphs) ------

def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _SYMM is not None and _SYMM.fits(x):
        return _SYMM.all_reduce(x)
    out = x.clone()
    dist.all_reduce(out, group=_DEVICE_GROUP)
    return out


@opaque_op("tp_all_reduce", _tp_all_reduce).register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _tp_all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """x [N, S] -> [N, world_size * S], rank r's block at columns [r * S, (r + 1) * S)."""
    x = x.contiguous()
    if _DEVICE_GROUP is not None and dist.get_backend(_DEVICE_GROUP) == "nccl":
        stacked = torch.empty((world_size, *x.shape), dtype=x.dtype, device=x.device)  # [W, N, S]
        dist.all_gather_into_tensor(stacked, x, group=_DEVICE_GROUP)
        parts = list(stacked.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x, group=_DEVICE_GROUP)
    return torch.cat(parts, dim=-1)


@opaque_op("tp_all_gather", _tp_all_gather).register_fake
def _(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world_size))


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (x itself with one rank)."""
    if _STATE.world_size == 1:
        return x
    return torch.ops.graphrunner.tp_all_reduce(x) if torch.compiler.is_compiling() else _tp_all_reduce(x)


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """x [N, S] -> [N, world * S], the ranks' blocks side by side (x itself with one rank)."""
    if _STATE.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.tp_all_gather(x, _STATE.world_size)
    return _tp_all_gather(x, _STATE.world_size)
