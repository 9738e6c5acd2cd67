"""AsyncLLM: an asyncio front over one engine loop, which runs either in a thread of this process
(`AsyncLLM.from_engine`) or in its own process (`AsyncLLM.from_engine_args(..., engine_process=True)`, what
`graphrunner serve` uses, so HTTP work never holds the loop's GIL). The loop reports token-id deltas; each
request's stream merges them, makes the text (graphrunner/output_stream.py) and its consumer reads the newest
cumulative RequestOutput.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from graphrunner.engine import Engine
from graphrunner.engine_args import EngineArgs
from graphrunner.engine_core import AddRequest, EngineCore, EngineDead, LoopStats, QueueFull
from graphrunner.generation_config import generation_defaults
from graphrunner.output_stream import DeltaCursor, MergedStream
from graphrunner.outputs import RequestOutput, TokenDeltas
from graphrunner.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDead", "LoopStats", "QueueFull"]


class CoreClient(Protocol):
    """Where the engine loop runs: a thread here (_ThreadCore) or a process (engine_core_process.ProcessCore).
    Both call `deliver(outputs)` / `deliver_ids(deltas)` and, once, `die(exc)` from a thread of their own."""

    def add(self, command: AddRequest, future: concurrent.futures.Future[str]) -> None: ...
    def abort(self, request_id: str, future: concurrent.futures.Future[Any] | None) -> None: ...
    def stop_completion(self, request_id: str, index: int, num_tokens: int, stop: str) -> None: ...
    def prometheus_text(self) -> str: ...
    def set_metrics_label(self, name: str, value: str) -> None: ...
    def shutdown(self, abort: bool, timeout: float | None) -> None: ...
    def is_alive(self) -> bool: ...


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | list[int] | BaseException]  # list[int]: a TokenDeltas report


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncLLM:
    """Serve many concurrent `generate()` calls from one engine loop (see the module docstring)."""

    def __init__(self, config: Any, tokenizer: Any, core_factory: Callable[[AsyncLLM], CoreClient]) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._defaults: dict[str, Any] | None = None  # generation_config.json's, read on first use
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        self._core = core_factory(self)

    @classmethod
    def from_engine(cls, engine: Engine, max_waiting_requests: int | None = None) -> AsyncLLM:
        """The loop in a thread of this process, over an Engine built here."""
        return cls(engine.config, engine.tokenizer,
                   lambda front: _ThreadCore(EngineCore(engine, max_waiting_requests, front.deliver, front.deliver_ids),
                                             front.die))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, max_waiting_requests: int | None = None,
                         engine_process: bool = False) -> AsyncLLM:
        """engine_process: run the engine (model, scheduler, detokenization) in its own process; this process
        keeps only HTTP, the tokenizer for chat templates and /tokenize, and merging outputs."""
        config = engine_args.create_engine_config()
        if not engine_process:
            return cls.from_engine(Engine(config), max_waiting_requests)
        from graphrunner.engine_core_process import ProcessCore
        from graphrunner.tokenizer import load_tokenizer

        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer_dir)
        return cls(config, tokenizer,
                   lambda front: ProcessCore(config, max_waiting_requests, front.deliver, front.deliver_ids,
                                             front.die))

    # -- what the server reads -----------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's generation_config.json defaults (vLLM's generation_config="auto")."""
        if self._defaults is None:
            self._defaults = generation_defaults(self.config.generation_config, self.config.model_dir)
        return SamplingParams.from_optional(**self._defaults) if self._defaults else SamplingParams()

    def prometheus_text(self) -> str:
        """The engine's metrics and loop counters, read between steps (blocks until the loop answers)."""
        return self._core.prometheus_text()

    def set_metrics_label(self, name: str, value: str) -> None:
        """A label on every engine metric (the server's model_name, as vLLM's)."""
        self._core.set_metrics_label(name, value)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._core.is_alive()

    # -- the public coroutines -----------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until its final one: cumulative, or only what is new with output_kind=DELTA
        (vLLM's), or only the final one with FINAL_ONLY. ValueError (bad input), QueueFull (overload) or
        EngineDead are raised before the first yield; closing the iterator aborts the request."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._check_alive()
            self._streams[rid] = stream
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        finished = False
        try:
            self._core.add(AddRequest(prompt, params, rid), future)
            try:
                await asyncio.wrap_future(future)
            except BaseException as exc:
                # refused: nothing was queued. Cancelled while waiting: it may yet be queued, so abort it below
                finished = not isinstance(exc, asyncio.CancelledError)
                raise
            merged = MergedStream(params, self._tokenizer)
            delta = DeltaCursor() if params.output_kind is RequestOutputKind.DELTA else None
            while True:
                item = await stream.queue.get()
                while True:  # merge every delta that arrived; the consumer reads only the newest state
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    if isinstance(item, list):
                        merged.add_ids(item)
                    else:
                        merged.add(item)
                    if merged.finished or stream.queue.empty():
                        break
                    item = stream.queue.get_nowait()
                for index, num_tokens, stop in merged.pending_stops:  # stop strings found here end them there
                    self._core.stop_completion(rid, index, num_tokens, stop)
                merged.pending_stops.clear()
                finished = merged.finished
                yield merged.output() if delta is None else delta(merged.output())
                if finished:
                    return
        finally:
            with self._lock:
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
            if not finished:  # closed early (client gone) or cancelled: abort at the next step boundary
                self._core.abort(rid, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request (its stream receives the final output, finish_reason "abort"); unknown ids are ignored."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._core.abort(request_id, future)
        await asyncio.wrap_future(future)

    def shutdown(self, abort: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the engine loop: abort in-flight requests (abort=True) or let them finish first."""
        self._stopping = True
        self._core.shutdown(abort, timeout)

    # -- called by the core's thread -------------------------------------------------------------
    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not one per output."""
        self._hand_over([(out.request_id, out) for out in outputs])

    def deliver_ids(self, deltas: TokenDeltas) -> None:
        """Hand a step's token-id reports to their streams (before that step's outputs, if any)."""
        self._hand_over(list(zip(deltas.request_ids, deltas.token_ids)))

    def _hand_over(self, items: list[tuple[str, Any]]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, pairs in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the caller's event loop is closed: nobody listens any more
                pass

    def die(self, exc: BaseException) -> None:
        """The loop ended: every waiting stream gets the error (EngineDead for a plain shutdown)."""
        with self._lock:
            if self._dead is None:
                self._dead = exc
            streams, self._streams = list(self._streams.values()), {}
        error = exc if isinstance(exc, Exception) else EngineDead(str(exc))
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass

    def _check_alive(self) -> None:
        if self._dead is not None or self._stopping:
            raise EngineDead(f"the engine loop is not running ({self._dead or 'shut down'})")


class _ThreadCore:
    """The engine loop in a daemon thread of this process: commands wait in a locked queue and are applied
    between steps; the thread idles on a Condition when there is nothing to do and never dies silently."""

    def __init__(self, core: EngineCore, die: Callable[[BaseException], None]) -> None:
        self.core = core
        self._die = die
        self._cond = threading.Condition()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._stop: str | None = None  # None | "finish" | "abort"
        self._dead: BaseException | None = None
        self._engine_lock = threading.Lock()  # held by the loop thread while it touches the engine
        self._thread = threading.Thread(target=self._run, name="graphrunner-engine-loop", daemon=True)
        self._thread.start()

    def add(self, command: AddRequest, future: concurrent.futures.Future[str]) -> None:
        self._post(("add", command, future))

    def abort(self, request_id: str, future: concurrent.futures.Future[Any] | None) -> None:
        self._post(("abort", request_id, future))

    def stop_completion(self, request_id: str, index: int, num_tokens: int, stop: str) -> None:
        self._post(("stop", (request_id, index, num_tokens, stop), None))

    def prometheus_text(self) -> str:
        with self._engine_lock:
            return self.core.prometheus_text()

    def set_metrics_label(self, name: str, value: str) -> None:
        with self._engine_lock:
            self.core.set_metrics_label(name, value)

    def is_alive(self) -> bool:
        return self._dead is None and self._stop is None and self._thread.is_alive()

    def shutdown(self, abort: bool, timeout: float | None) -> None:
        with self._cond:
            if self._stop is None or abort:
                self._stop = "abort" if abort else "finish"
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _post(self, command: tuple[Any, ...]) -> None:
        with self._cond:
            dead = self._dead
            if dead is None and self._stop is None:
                self._commands.append(command)
                self._cond.notify_all()
                return
        _refuse(command, EngineDead(f"the engine loop is not running ({dead or 'shut down'})"))

    def _next_commands(self) -> tuple[list[tuple[Any, ...]], str | None]:
        """Wait (without spinning) until there is a command, work or a stop; take every queued command."""
        with self._cond:
            while not self._commands and self._stop is None and not self.core.has_work():
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
                        _apply(self.core, command)
                    if stop == "abort":
                        self.core.abort_all()
                    if stop is not None and not self.core.has_work():
                        break
                    if self.core.has_work():
                        self.core.step()
        except BaseException as exc:  # never die silently: every waiting stream gets the error
            logger.exception("the engine loop thread failed")
            self._end(exc)
            return
        self._end(EngineDead("the engine was shut down"))

    def _end(self, exc: BaseException) -> None:
        with self._cond:
            self._dead = exc
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            _refuse(command, EngineDead(f"the engine loop is not running ({exc})"))
        self._die(exc)
        self.core.shutdown()


def _apply(core: EngineCore, command: tuple[Any, ...]) -> None:
    kind, arg, future = command
    if kind == "add":
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(core.add(arg))
        except Exception as exc:  # noqa: BLE001 -- ValueError, QueueFull, ...: the caller gets it, nothing queued
            future.set_exception(exc)
        return
    if kind == "stop":
        core.stop_completion(*arg)
        return
    core.abort(arg)
    if future is not None:
        future.set_result(None)


def _refuse(command: tuple[Any, ...], error: EngineDead) -> None:
    kind, _, future = command
    if future is None:
        return
    if kind == "add":
        future.set_exception(error)
    else:
        future.set_result(None)
