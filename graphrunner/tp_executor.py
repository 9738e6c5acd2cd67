"""Tensor parallelism's processes: rank 0 is the engine's own process driving its runner; ranks 1..N-1 are
spawned worker processes that replay every step rank 0 ships them (graphrunner.tp_plan) on their own device.

Rank 0 sends a step's plan down a pipe and launches the step itself; nothing waits for the workers but the
collectives inside the step. A worker that dies ends the engine with an error naming it (graphrunner.tp_workers):
a watcher thread sees the process exit (and aborts the communicators on GPU, so nothing stays blocked in a collective), every later
step raises at once, and collectives time out after GRAPHRUNNER_TP_TIMEOUT_S seconds whatever happens (eager ones
through the process group's timeout, those inside CUDA graphs through the deadline on each step's output).
Shutting down drops every CUDA graph before leaving the group: NCCL cannot free a communicator that a live graph
holds. GRAPHRUNNER_LOG_LEVEL=INFO logs each rank's start-up stages (DEBUG: each graph and step), and
GRAPHRUNNER_TP_STACKS_AFTER_S=N makes a worker print its stacks after N s without a new plan.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from graphrunner.async_output import AsyncStepOutput
from graphrunner.config import EngineConfig
from graphrunner.env import env_number
from graphrunner.log_setup import configure_from_env
from graphrunner.parallel_state import (
    abort_tensor_parallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from graphrunner.runner import ModelRunner
from graphrunner.scheduler import SchedulerOutput
from graphrunner.symm_all_reduce import check_first_engine
from graphrunner.tp_plan import RowMirror, encode_plan
from graphrunner.tp_workers import WatchedOutput, WorkerDied, Workers
from graphrunner.worker import build_runner
from model_states import ModelState

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # a collective (or the start-up rendezvous, or a step's output) waiting longer than this fails
STACKS_ENV = "GRAPHRUNNER_TP_STACKS_AFTER_S"  # a worker that receives no plan for this long prints its threads' stacks


def collective_timeout_s() -> float:
    return env_number("GRAPHRUNNER_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S, valid=lambda v: v > 0, rule="> 0 (seconds)")


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config rank `rank` builds its runner from: on CUDA, device cuda:rank."""
    if config.device.type != "cuda":
        return config
    return dataclasses.replace(config, device=torch.device("cuda", rank))


# ---- the worker process --------------------------------------------------------------------------

def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:  # re-parented: the engine process is gone
            os._exit(3)


def _worker_main(rank: int, config: EngineConfig, port: int, conn: mpc.Connection, timeout_s: float) -> None:
    """Rank `rank`: join the group, build the runner, then run every plan rank 0 sends until STOP or EOF."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    configure_from_env(f"tp{rank}")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # rank 0 asks for the stacks when a step stalls
    stall_s = _stall_dump_seconds()
    _rearm_stack_dump(stall_s)
    world = config.tensor_parallel_size
    runner: ModelRunner | None = None
    graceful = True
    try:
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)  # before any CUDA work: never a context on another rank's GPU
        else:  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        store.set(f"graphrunner_tp_joined_{rank}", "1")
        init_tensor_parallel(rank, world, store, config.device, timeout_s)
        logger.info("rank %d: joined the process group (%s)", rank, dist.get_backend())
        runner, num_blocks = build_runner(config)
        conn.send(("ready", num_blocks))
        mirror = RowMirror()
        recent: deque[AsyncStepOutput] = deque(maxlen=2)  # keeps the last steps' copy buffers alive
        steps = 0
        while True:
            sched = mirror.decode(conn.recv_bytes())
            _rearm_stack_dump(stall_s)
            if sched is None:
                break
            recent.append(runner.execute(sched))
            steps += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("rank %d: step %d launched (%d requests, %d tokens)", rank, steps, len(sched.scheduled),
                             sum(s.num_tokens for s in sched.scheduled))
        logger.info("rank %d: STOP after %d steps", rank, steps)
    except EOFError:  # the engine closed its end without STOP: it is gone (a collective could wait for good)
        graceful = False
    except BaseException:  # noqa: BLE001 -- reported to rank 0, then this process ends
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        os._exit(1)  # no clean-up that could wait on a collective
    faulthandler.cancel_dump_traceback_later()
    if runner is not None:
        runner.release_graphs()  # first: a live graph holding collectives keeps NCCL from freeing the communicator
    on_cuda = config.device.type == "cuda"
    left = destroy_tensor_parallel() if graceful or not on_cuda else abort_tensor_parallel()
    logger.info("rank %d: %s the process group", rank, "left" if left else "could not leave")
    if not left:  # a stuck communicator could also hang the interpreter's exit
        sys.stderr.flush()
        os._exit(0)


def _stall_dump_seconds() -> float | None:
    value = env_number(STACKS_ENV, None, rule="of seconds (<= 0: off)")
    return value if value is not None and value > 0 else None


def _rearm_stack_dump(stall_s: float | None) -> None:
    """Print every thread's stack each `stall_s` seconds until the next plan arrives (off when None)."""
    if stall_s is not None:
        faulthandler.dump_traceback_later(stall_s, repeat=True)


# ---- rank 0 ------------------------------------------------------------------------------------

class TensorParallelExecutor:
    """Rank 0's runner and the worker processes of ranks 1..N-1; stands where the engine keeps its runner
    (`execute`, and every other runner attribute delegated to rank 0's)."""

    def __init__(self, config: EngineConfig, model_state: ModelState | None = None) -> None:
        world = config.tensor_parallel_size
        timeout_s = collective_timeout_s()
        _stall_dump_seconds()  # (a bad value fails here, not in a worker)
        check_first_engine(rank_config(config, 0).device)  # (before any worker starts: nothing to tear down)
        configure_from_env("tp0")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timeout)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, world):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, args=(rank, rank_config(config, rank), store.port, theirs, timeout_s),
                               name=f"graphrunner-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        self._workers = Workers(procs, conns, config.device.type == "cuda")
        self._finalizer = weakref.finalize(self, self._workers.close)
        self._failed: str | None = None
        self._timeout_s = timeout_s
        self._steps = 0
        logger.info("rank 0: started %d worker process(es) %s", len(procs), [p.pid for p in procs])
        try:
            self._wait(lambda: store.check([f"graphrunner_tp_joined_{r}" for r in range(1, world)]), timeout_s,
                       "join the process group")
            init_tensor_parallel(0, world, store, rank_config(config, 0).device, timeout_s)
            logger.info("rank 0: joined the process group (%s)", dist.get_backend())
            self.runner, self.num_blocks = build_runner(rank_config(config, 0), model_state)
            self._workers.release_graphs = self.runner.release_graphs
            for rank, conn in enumerate(conns, start=1):
                self._wait(conn.poll, timeout_s, "build its model")
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    raise WorkerDied(self._workers.death_after_error() or f"tensor-parallel worker rank {rank} "
                                     f"closed its pipe while starting") from None
                if kind != "ready" or payload != self.num_blocks:
                    raise WorkerDied(f"tensor-parallel worker rank {rank} did not start: {kind} {payload}")
        except BaseException as exc:
            reason = self._workers.death_after_error()
            self.shutdown()
            if reason is not None and isinstance(exc, Exception):
                raise WorkerDied(reason) from exc
            raise

    def _wait(self, done: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            reason = self._workers.note_death()
            if reason is not None:
                raise WorkerDied(reason)
            if time.monotonic() > deadline:
                self._workers.dump_worker_stacks()
                raise WorkerDied(f"tensor-parallel workers did not {what} within {timeout_s:.0f} s "
                                 f"(GRAPHRUNNER_TP_TIMEOUT_S; the workers' stacks are on stderr)")
            time.sleep(0.01)

    def execute(self, sched: SchedulerOutput) -> AsyncStepOutput | WatchedOutput:
        """Ship the plan to every worker, then launch the step here; the output is read as the runner's is."""
        if self._failed is not None:
            raise WorkerDied(self._failed)
        if self._workers.dead is not None:  # a worker exited, or a step stalled: the ranks are out of step
            self._failed = self._workers.dead
            raise WorkerDied(self._failed)
        try:
            plan = encode_plan(sched)
            for conn in self._workers.conns:
                conn.send_bytes(plan)
            out = self.runner.execute(sched)
            self._steps += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("rank 0: step %d launched (%d requests, %d tokens)", self._steps, len(sched.scheduled),
                             sum(s.num_tokens for s in sched.scheduled))
        except BaseException as exc:
            # the ranks may now disagree about the state table: nothing more can run on this engine
            dead = self._workers.death_after_error()
            self._failed = (dead or f"a step failed on rank 0 ({type(exc).__name__}: {exc}), leaving the "
                            f"tensor-parallel ranks out of step") + "; create a new engine"
            self.shutdown()
            if isinstance(exc, Exception):
                raise WorkerDied(self._failed) from exc
            raise
        return WatchedOutput(out, self._workers, self._timeout_s)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._workers.procs]

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (also done when the executor is dropped); the runner's CUDA
        graphs are dropped first, and later steps raise."""
        if self._failed is None:
            self._failed = "this tensor-parallel engine was shut down"
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        if name == "runner":  # not built (a failed start): no delegation
            raise AttributeError(name)
        return getattr(self.runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        own = hasattr(type(self), name) or name in ("runner", "num_blocks") or name.startswith("_")
        if own or "runner" not in self.__dict__:  # (e.g. a wrapped execute: the executor's, around rank 0's)
            object.__setattr__(self, name, value)
        else:  # e.g. a test swapping a runner method: it is rank 0's runner that runs
            setattr(self.runner, name, value)


def build_engine_runner(config: EngineConfig, model_state: ModelState | None = None
                        ) -> tuple[ModelRunner | TensorParallelExecutor, int]:
    """The engine's runner and its KV block count: one process, or rank 0 of tensor_parallel_size processes."""
    if config.tensor_parallel_size == 1:
        return build_runner(config, model_state)
    executor = TensorParallelExecutor(config, model_state)
    return executor, executor.num_blocks
