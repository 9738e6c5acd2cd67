"""Rank 0's view of the tensor-parallel worker processes: their deaths (seen from /proc the moment a killed
worker starts to exit, since a GPU peer's sentinel can stay silent while rank 0's collectives hold its memory),
stalls past the step deadline, and the teardown that leaves the process group with them or aborts it."""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from graphrunner.async_output import AsyncStepOutput, StepOutput
from graphrunner.parallel_state import TEARDOWN_TIMEOUT_S, abort_tensor_parallel, destroy_tensor_parallel
from graphrunner.proc_exit import exit_code_if_exiting
from graphrunner.tp_plan import STOP

logger = logging.getLogger("graphrunner.tp_executor")  # (one logger for the TP machinery)

DEATH_POLL_S = 0.05  # while a step's output is pending, how often the workers' /proc state is read


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited (or a step failed and left the ranks out of step)."""



class Workers:
    """The spawned processes, their pipes, and what is known about their deaths (no reference to the executor,
    so that dropping the engine shuts them down)."""

    def __init__(self, procs: list[Any], conns: list[mpc.Connection], on_cuda: bool) -> None:
        self.procs = procs
        self.conns = conns
        self.on_cuda = on_cuda
        self.closing = False
        self.dead: str | None = None
        # rank 0's runner.release_graphs, once built: called before the group is left (see close)
        self.release_graphs: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="graphrunner-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        mpc.wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        self.note_death()
        # While rank 0 builds its runner it may block in a device sync on a collective the dead rank never joins:
        # abort (its graphs, if any, are dropped as the build fails, which lets the abort finish). Once built, rank 0
        # never blocks on the device (outputs are polled), and close() drops the graphs before it aborts.
        if self.on_cuda and self.release_graphs is None:
            abort_tensor_parallel()

    def note_death(self) -> str | None:
        """The reason, once a worker has exited unexpectedly (None while all live)."""
        with self._lock:
            if self.dead is None and not self.closing:
                for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
                    # a killed GPU worker may not be reapable (nor its sentinel ready) while rank 0's collectives
                    # still hold its memory: /proc shows the exit at once
                    code = exit_code_if_exiting(proc.pid) if proc.is_alive() else proc.exitcode
                    if code is None:
                        continue
                    detail = ""
                    try:
                        while conn.poll():
                            kind, payload = conn.recv()
                            if kind == "error":
                                detail = f"; its error:\n{payload}"
                    except (EOFError, OSError, ValueError):
                        pass
                    self.dead = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}{detail}"
                    break
            return self.dead

    def death_after_error(self, grace_s: float = 2.0) -> str | None:
        """After a collective failed: the dead worker's reason, waiting briefly, since a killed peer's sockets
        close a moment before its exit can be collected."""
        deadline = time.monotonic() + grace_s
        while self.note_death() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.dead

    def stalled(self, reason: str) -> None:
        """A step's output did not arrive in time: mark the ranks out of step and have each live worker print its
        stacks (faulthandler on SIGUSR1) so that the log shows where it waits."""
        with self._lock:
            if self.dead is None:
                self.dead = reason
        self.dump_worker_stacks()

    def dump_worker_stacks(self) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)  # (the dump is written by the worker; give it a moment before anything kills it)

    def close(self) -> None:
        """Drop rank 0's graphs, tell the workers to stop, leave the group with them (a graceful destroy is
        collective in recent NCCL: every rank at about the same time, so not after waiting for their exit), then
        collect them. A dead or stalled peer: abort instead (needs no peer)."""
        self.closing = True
        release, self.release_graphs = self.release_graphs, None
        # (gloo's destroy is local, and gloo has no abort)
        healthy = not self.on_cuda or (self.dead is None and all(p.is_alive() for p in self.procs))
        aborting = None
        if not healthy:  # abort beside the release: graph kernels stuck on the dead peer exit once it is flagged,
            # and the abort ends once the graphs are gone
            aborting = threading.Thread(target=abort_tensor_parallel, name="graphrunner-tp-abort", daemon=True)
            aborting.start()
        if release is not None:
            release()  # before leaving: a live graph holding collectives keeps NCCL from freeing the communicator
        for conn in self.conns:
            try:
                conn.send_bytes(STOP)
            except (OSError, ValueError):
                pass
        if aborting is None:
            left = destroy_tensor_parallel()
        else:
            aborting.join(TEARDOWN_TIMEOUT_S)
            left = not aborting.is_alive()
        logger.info("rank 0: %s the process group", ("left" if healthy else "aborted") if left else "could not leave")
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                print(f"graphrunner: tensor-parallel worker {proc.name} (pid {proc.pid}) did not exit after STOP; "
                      f"killing it", file=sys.stderr)
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


class WatchedOutput:
    """A step's output whose wait also watches the workers: on GPU a dead peer would leave the step's
    collectives (and so its event) pending."""

    def __init__(self, inner: AsyncStepOutput, workers: Workers, timeout_s: float) -> None:
        self._inner = inner
        self._workers = workers
        self._timeout_s = timeout_s

    def result(self) -> StepOutput:
        # collectives replayed inside CUDA graphs are not watched by NCCL's watchdog: without this deadline a rank
        # waiting on a live but stuck (or out-of-step) peer would wait for good
        start = time.monotonic()
        deadline, next_look = start + self._timeout_s, start + DEATH_POLL_S
        while not self._inner.ready():
            if self._workers.dead is not None:  # set by the watcher thread the moment a worker is reaped
                raise WorkerDied(self._workers.dead)
            now = time.monotonic()
            if now > next_look:  # (a step that takes this long is rare: look at the workers' /proc state)
                next_look = now + DEATH_POLL_S
                if self._workers.note_death() is not None:
                    raise WorkerDied(self._workers.dead)
            if now > deadline:
                self._workers.stalled(f"a tensor-parallel step's output did not arrive within {self._timeout_s:.0f} s "
                                      f"(GRAPHRUNNER_TP_TIMEOUT_S): a rank is stuck or the ranks are out of step "
                                      f"(the workers' stacks are on stderr); create a new engine")
                raise WorkerDied(self._workers.dead)
            time.sleep(0)  # let other threads (the async front end) run while the device works
        return self._inner.result()
