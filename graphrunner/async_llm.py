"""AsyncLLM: an asyncio front over one Engine, stepped by a dedicated engine-loop thread.

Submissions and aborts reach the loop thread through a locked command queue and are applied between steps;
each request's outputs (cumulative RequestOutputs) come back to its asyncio queue via call_soon_threadsafe.
The loop thread idles on a Condition when there is nothing to do and never dies silently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from graphrunner.engine import Engine, StepFailed
from graphrunner.engine_args import EngineArgs
from graphrunner.llm_engine import LLMEngine
from graphrunner.outputs import RequestOutput
from graphrunner.sampling_params import RequestOutputKind, SamplingParams
from graphrunner.tp_executor import WorkerDied

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests are waiting than `max_waiting_requests` allows; try again later."""


class EngineDead(RuntimeError):
    """The engine loop thread stopped (shut down, or an unexpected error); no request can run."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody listens any more
            pass


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


@dataclass
class _Add:
    prompt: Any
    params: SamplingParams
    request_id: str
    stream: _Stream
    future: concurrent.futures.Future[str]


@dataclass
class LoopStats:
    """Where the loop thread's time goes while it has work: inside engine.step(), handing outputs to the
    streams, and between steps (commands, waiting for the GIL). Lets a benchmark show that HTTP work does not
    stall the loop: compare step time per step here with an offline run of the same load."""

    steps: int = 0
    step_s: float = 0.0     # inside engine.step()
    deliver_s: float = 0.0  # handing outputs to the asyncio streams
    between_s: float = 0.0  # from one step's end to the next step's start, only when steps run back to back
    _last_end: float | None = None

    def note(self, start: float, stepped: float, end: float) -> None:
        if self._last_end is not None and start - self._last_end < 0.1:  # an idle loop is not a stall
            self.between_s += start - self._last_end
        self.steps += 1
        self.step_s += stepped - start
        self.deliver_s += end - stepped
        self._last_end = end

    def prometheus_text(self) -> str:
        return "".join(f"# TYPE graphrunner:engine_loop_{name} counter\ngraphrunner:engine_loop_{name} {value}\n"
                       for name, value in (("steps_total", self.steps), ("step_seconds_total", self.step_s),
                                           ("deliver_seconds_total", self.deliver_s),
                                           ("between_steps_seconds_total", self.between_s)))


class AsyncLLM:
    """Serve many concurrent `generate()` calls from one engine (see the module docstring)."""

    def __init__(self, engine: Engine, max_waiting_requests: int | None = None) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self._llm_engine: LLMEngine | None = None  # built on first use (the generation_config defaults)
        self.max_waiting_requests = max_waiting_requests
        self._cond = threading.Condition()
        self._commands: deque[Any] = deque()
        self._stop: str | None = None  # None | "finish" | "abort"
        self._dead: BaseException | None = None
        self._streams: dict[str, _Stream] = {}  # loop-thread only
        self._engine_lock = threading.Lock()  # held by the loop thread while it touches the engine
        self.loop_stats = LoopStats()
        self._thread = threading.Thread(target=self._run, name="graphrunner-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, max_waiting_requests: int | None = None) -> AsyncLLM:
        return cls(Engine(engine_args.create_engine_config()), max_waiting_requests)

    # -- properties the server needs ---------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def stats(self) -> Any:
        return self.engine.stats

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        if self._llm_engine is None:
            self._llm_engine = LLMEngine(self.engine)
        return self._llm_engine.get_default_sampling_params()

    def prometheus_text(self) -> str:
        """engine.stats.to_prometheus_text(), read between steps (the loop thread mutates the stats)."""
        with self._engine_lock:
            return self.engine.stats.to_prometheus_text() + self.loop_stats.prometheus_text()

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._stop is None and self._thread.is_alive()

    # -- the public coroutines ---------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until its final one. ValueError (bad input), QueueFull (overload)
        or EngineDead are raised before the first yield; closing the iterator aborts the request."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.output_kind is RequestOutputKind.DELTA:
            raise ValueError("output_kind=DELTA is not supported: outputs are cumulative")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._post(_Add(prompt, params, rid, stream, future))
        finished = False
        try:
            await asyncio.wrap_future(future)
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: a consumer that fell behind (a loaded server) needs only the newest,
                # so its per-output work (SSE chunks, JSON) shrinks exactly when it would stall the engine loop.
                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # closed early (client gone) or cancelled: abort at the next step boundary
                self._post(("abort", rid, None))

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream receives the final output, finish_reason "abort"); unknown ids are ignored."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._post(("abort", request_id, future))
        await asyncio.wrap_future(future)

    def shutdown(self, abort: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the loop thread: abort in-flight requests (abort=True) or let them finish first."""
        with self._cond:
            if self._stop is None or abort:
                self._stop = "abort" if abort else "finish"
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- loop thread -------------------------------------------------------------------------
    def _post(self, command: Any) -> None:
        with self._cond:
            dead = self._dead
            if dead is None and self._stop is None:
                self._commands.append(command)
                self._cond.notify_all()
                return
        error = EngineDead(f"the engine loop is not running ({dead or 'shut down'})")
        if isinstance(command, _Add):
            command.future.set_exception(error)
        elif isinstance(command, tuple) and command[2] is not None:
            command[2].set_result(None)

    def _next_commands(self) -> tuple[list[Any], str | None]:
        """Wait (without spinning) until there is a command, work or a stop; take every queued command."""
        with self._cond:
            while not self._commands and self._stop is None and not self.engine.has_unfinished():
                self._cond.wait()
            commands = list(self._commands)
            self._commands.clear()
            return commands, self._stop

    def _run(self) -> None:
        try:
            while True:
                commands, stop = self._next_commands()
                with self._engine_lock:
                    for command in commands:
                        self._apply(command)
                    if stop == "abort":
                        self._abort_everything()
                    if stop is not None and not self.engine.has_unfinished():
                        break
                    if self.engine.has_unfinished():
                        self._step()
        except BaseException as exc:  # never die silently: every waiting stream gets the error
            logger.exception("the engine loop thread failed")
            self._die(exc)
            self.engine.shutdown()
            return
        self._die(EngineDead("the engine was shut down"))
        self.engine.shutdown()  # tensor-parallel workers, if any

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except StepFailed as exc:
            logger.error("%s", exc)
            outputs = exc.outputs  # the failed requests' final outputs (finish_reason "error"); the loop goes on
            if isinstance(exc.__cause__, WorkerDied):  # ... unless a tensor-parallel rank is gone: then it ends
                self._deliver(outputs)
                raise exc.__cause__ from exc
        t1 = time.perf_counter()
        self._deliver(outputs)
        self.loop_stats.note(t0, t1, time.perf_counter())

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            if not command.future.set_running_or_notify_cancel():
                return
            try:
                self._check_queue(command.params)
                rid = self.engine.add_request(command.prompt, command.params, command.request_id,
                                              final_only=command.params.output_kind is RequestOutputKind.FINAL_ONLY)
            except Exception as exc:  # noqa: BLE001 -- ValueError, QueueFull, ...: the caller gets it, nothing queued
                command.future.set_exception(exc)
                return
            self._streams[rid] = command.stream
            command.future.set_result(rid)
            return
        _, rid, future = command
        out = self.engine.abort_request(rid)
        if out is not None:
            self._deliver([out])
        if future is not None:
            future.set_result(None)

    def _check_queue(self, params: SamplingParams) -> None:
        bound = self.max_waiting_requests
        waiting = len(self.engine.scheduler.waiting)
        if bound is not None and waiting + params.n > bound:
            raise QueueFull(f"too many requests waiting ({waiting} sequences, max_waiting_requests={bound}); "
                            "retry later")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per output."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody listens any more
                pass

    def _abort_everything(self) -> None:
        for rid in list(self._streams):
            out = self.engine.abort_request(rid)
            if out is not None:
                self._deliver([out])

    def _die(self, exc: BaseException) -> None:
        with self._cond:
            self._dead = exc
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, _Add):
                command.future.set_exception(EngineDead(f"the engine loop is not running ({exc})"))
            elif command[2] is not None:
                command[2].set_result(None)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc if isinstance(exc, Exception) else EngineDead(str(exc)))
