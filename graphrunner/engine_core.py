"""The engine loop's body, wherever it runs (AsyncLLM's loop thread, or the engine-core process): apply
submissions, aborts and stop-string ends between steps, step, and hand every step's outputs (token-id deltas:
ParentRequest.delta_output) to an `emit` callback; the front detokenizes. Keeps the loop counters (LoopStats).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphrunner.engine import Engine, StepFailed
from graphrunner.outputs import RequestOutput, TokenDeltas
from graphrunner.sampling_params import RequestOutputKind, SamplingParams
from graphrunner.tp_workers import WorkerDied

logger = logging.getLogger(__name__)

# A process where a thread hands outputs to another (the engine loop to the HTTP event loop, or to the pipe's
# sender) runs with this GIL switch interval: an output handed over waits at most this long for its thread.
SWITCH_INTERVAL_S = 0.0005


class QueueFull(RuntimeError):
    """More requests are waiting than `max_waiting_requests` allows; try again later."""


class EngineDead(RuntimeError):
    """The engine loop stopped (shut down, or an unexpected error); no request can run."""


@dataclass
class AddRequest:
    prompt: Any
    params: SamplingParams
    request_id: str


@dataclass
class LoopStats:
    """Where the loop's time goes while it has work: inside engine.step(), handing outputs on (to the streams,
    or to the pipe), and between steps (commands, waiting for the GIL). Compare step time per step here with an
    offline run of the same load to see whether HTTP work stalls the loop."""

    steps: int = 0
    step_s: float = 0.0     # inside engine.step()
    wait_s: float = 0.0     # of which blocked on the device's results (~0: the loop is host-bound)
    deliver_s: float = 0.0  # handing outputs on
    between_s: float = 0.0  # from one step's end to the next step's start, only when steps run back to back
    _last_end: float | None = None

    def note(self, start: float, stepped: float, end: float, wait: float = 0.0) -> None:
        if self._last_end is not None and start - self._last_end < 0.1:  # an idle loop is not a stall
            self.between_s += start - self._last_end
        self.steps += 1
        self.step_s += stepped - start
        self.wait_s += wait
        self.deliver_s += end - stepped
        self._last_end = end

    def prometheus_text(self) -> str:
        return "".join(f"# TYPE graphrunner:engine_loop_{name} counter\ngraphrunner:engine_loop_{name} {value}\n"
                       for name, value in (("steps_total", self.steps), ("step_seconds_total", self.step_s),
                                           ("wait_seconds_total", self.wait_s),
                                           ("deliver_seconds_total", self.deliver_s),
                                           ("between_steps_seconds_total", self.between_s)))


class EngineCore:
    """One Engine driven by one thread: `add` / `abort` between steps, `step` while `has_work()`."""

    def __init__(self, engine: Engine, max_waiting_requests: int | None,
                 emit: Callable[[list[RequestOutput]], None],
                 emit_ids: Callable[[TokenDeltas], None] | None = None) -> None:
        """emit: a step's RequestOutputs. emit_ids: a step's reports that are only new token ids (TokenDeltas),
        always handed on before that step's RequestOutputs; without it every report is a RequestOutput."""
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._emit = emit
        self._emit_ids = emit_ids
        if emit_ids is not None:
            engine.report_token_deltas()
        self.loop_stats = LoopStats()

    def add(self, command: AddRequest) -> str:
        """Queue one request (ValueError, QueueFull: nothing queued). Its reports are deltas of token ids, or only
        the final one for a FINAL_ONLY request (its only report: a delta too); the front detokenizes them."""
        self._check_queue(command.params)
        final_only = command.params.output_kind is RequestOutputKind.FINAL_ONLY
        rid = self.engine.add_request(command.prompt, command.params, command.request_id, final_only=final_only,
                                      delta=not final_only, detokenize=False)
        return rid

    def abort(self, request_id: str) -> None:
        """End a request with finish_reason "abort" (its final report is emitted); unknown ids are ignored."""
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._send([out])

    def stop_completion(self, request_id: str, index: int, num_tokens: int, stop: str) -> None:
        """The front found stop string `stop` in completion `index` after num_tokens tokens: end it there."""
        out = self.engine.stop_completion(request_id, index, num_tokens, stop)
        if out is not None:
            self._send([out])

    def abort_all(self) -> None:
        for rid in self.engine.request_ids():
            self.abort(rid)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> None:
        """One engine step and its outputs emitted. A StepFailed ends only its requests (their final outputs are
        emitted) unless a tensor-parallel worker died: then WorkerDied is raised and the loop must end."""
        t0, waited = time.perf_counter(), self.engine.result_wait_s
        try:
            outputs = self.engine.step()
        except StepFailed as exc:
            logger.error("%s", exc)
            outputs = exc.outputs
            if isinstance(exc.__cause__, WorkerDied):
                self._send_ids()
                self._send(outputs)
                raise exc.__cause__ from exc
        t1 = time.perf_counter()
        self._send_ids()  # first: a request's final output (below) follows its last ids
        self._send(outputs)
        self.loop_stats.note(t0, t1, time.perf_counter(), self.engine.result_wait_s - waited)

    def prometheus_text(self) -> str:
        return self.engine.stats.to_prometheus_text() + self.loop_stats.prometheus_text()

    def set_metrics_label(self, name: str, value: str) -> None:
        self.engine.stats.labels[name] = value

    def shutdown(self) -> None:
        self.engine.shutdown()  # tensor-parallel workers, if any

    def _send(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._emit(outputs)

    def _send_ids(self) -> None:
        if self._emit_ids is not None:
            deltas = self.engine.take_token_deltas()
            if deltas is not None:
                self._emit_ids(deltas)

    def _check_queue(self, params: SamplingParams) -> None:
        bound = self.max_waiting_requests
        waiting = len(self.engine.scheduler.waiting)
        if bound is not None and waiting + params.n > bound:
            raise QueueFull(f"too many requests waiting ({waiting} sequences, max_waiting_requests={bound}); "
                            "retry later")
