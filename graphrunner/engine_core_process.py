"""The engine loop in its own process (vLLM's EngineCore process): the model, scheduler and detokenization run
where no HTTP or asyncio work competes for the GIL. A spawn'd child steps an EngineCore and sends each step's
delta outputs through a pipe; in the server process, ProcessCore sends commands and a reader thread hands outputs
and replies on. Either side ending (crash, kill, shutdown) ends the other cleanly: never a hang.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from graphrunner.config import EngineConfig
from graphrunner.engine_core import SWITCH_INTERVAL_S, AddRequest, EngineCore, EngineDead
from graphrunner.metrics import RequestMetrics
from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput, TokenDeltas

logger = logging.getLogger(__name__)

# front -> core: ("add", token, AddRequest) | ("abort", token | None, request_id) | ("stats", token, None)
#                | ("label", None, (name, value)) | ("stop_completion", None, (request_id, index, kept, stop))
#                | ("stop", None, "abort" | "finish")
# core -> front: ("ready", None, None) | ("out", None, encode_outputs([RequestOutput]))
#                | ("ids", None, (request_ids, token_ids)): a TokenDeltas | ("reply", token, result)
#                | ("error", token, Exception) | ("dead", None, BaseException)


def encode_outputs(outputs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    """A step's outputs as plain tuples: pickling dataclasses costs ~10x more (0.29 vs 0.03 ms for 64 outputs on
    the dev CPU), and the engine loop pays it every step."""
    wire = []
    for o in outputs:
        m = o.metrics
        comps = tuple((c.index, c.token_ids, _encode_logprobs(c.logprobs), c.cumulative_logprob, c.finish_reason,
                       c.stop_reason) for c in o.outputs)
        wire.append((o.request_id, o.finished, o.num_cached_tokens,
                     None if m is None else (m.arrival_time, m.last_token_time, m.first_scheduled_time,
                                             m.first_token_time, m.time_in_queue, m.finished_time),
                     o.prompt, o.prompt_token_ids, _encode_logprobs(o.prompt_logprobs), comps))
    return wire


def decode_outputs(wire: list[tuple[Any, ...]]) -> list[RequestOutput]:
    outputs = []
    for rid, finished, cached, m, prompt, prompt_ids, prompt_lps, comps in wire:
        outs = [CompletionOutput(i, "", ids, cum, _decode_logprobs(lps), reason, stop)
                for i, ids, lps, cum, reason, stop in comps]
        outputs.append(RequestOutput(rid, prompt, prompt_ids, outs, finished, _decode_logprobs(prompt_lps),
                                     None if m is None else RequestMetrics(*m), cached))
    return outputs


def _encode_logprobs(entries: list[dict[int, Logprob] | None] | None) -> Any:
    if entries is None:
        return None
    return [None if e is None else {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()}
            for e in entries]


def _decode_logprobs(entries: Any) -> Any:
    if entries is None:
        return None
    return [None if e is None else {t: Logprob(*v) for t, v in e.items()} for e in entries]


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 -- an exception carrying unpicklable state: keep its text
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Outbox:
    """Every message to the server, in order, sent by a thread of its own: the loop never waits on the pipe (a
    full pipe, a server busy elsewhere) and pays no pickling while its step runs on the device. Outputs are
    encoded on this thread too. A step's few outputs (low concurrency: latency matters, pickling is cheap) go
    out at once from the loop when nothing is queued before them: the hand-over to the sender thread would add
    up to a GIL switch interval to TTFT and to every inter-token latency."""

    INLINE_MAX = 8  # outputs a step may send from the loop itself

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[str, Any, Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # held while a message is on its way: keeps the order
        self._queued = 0  # messages put on the queue and not yet sent
        self._thread = threading.Thread(target=self._run, name="graphrunner-engine-core-sender", daemon=True)
        self._thread.start()

    def put(self, message: tuple[str, Any, Any]) -> None:
        with self._lock:
            self._queued += 1
        self._queue.put(message)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        self._hand(("out", None, outputs), len(outputs))

    def token_deltas(self, deltas: TokenDeltas) -> None:
        self._hand(("ids", None, (deltas.request_ids, deltas.token_ids)), len(deltas))

    def _hand(self, message: tuple[str, Any, Any], size: int) -> None:
        if size <= self.INLINE_MAX and self._lock.acquire(blocking=False):
            try:
                if self._queued == 0:  # nothing waits ahead of it: sending now keeps the order
                    self._send(message)
                    return
            finally:
                self._lock.release()
        self.put(message)

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            with self._lock:
                self._queued -= 1
                if not self._send(message):
                    return  # the server is gone: the loop reads EOF and ends

    def _send(self, message: tuple[str, Any, Any]) -> bool:
        kind, token, arg = message
        try:
            self._conn.send((kind, token, encode_outputs(arg) if kind == "out" else arg))
            return True
        except OSError:
            return False


def run_engine_core(config: EngineConfig, conn: Connection, max_waiting_requests: int | None) -> None:
    """The child's main: build the engine, say ready, then loop until told to stop or the parent is gone."""
    # A SIGTERM or Ctrl-C sent to the whole process group (systemd, a terminal) is the server's to handle: it
    # drains its streams and then stops this loop. Killed outright, the child still ends: its pipe reads EOF.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The sender thread needs the GIL to put a step's outputs (or an add's reply) on the pipe while this loop
    # launches the next step; Python's default 5 ms switch interval would add up to 5 ms to TTFT and ITL
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s engine-core: %(message)s")
    outbox = _Outbox(conn)
    try:
        from graphrunner.engine import Engine

        core = EngineCore(Engine(config), max_waiting_requests, outbox.outputs, outbox.token_deltas)
    except BaseException as exc:  # noqa: BLE001 -- the parent shows why the engine could not start
        outbox.put(("dead", None, _picklable(exc)))
        outbox.close()
        return
    outbox.put(("ready", None, None))
    reason: BaseException = EngineDead("the engine was shut down")
    try:
        _loop(core, conn, outbox)
    except EOFError:  # the server process is gone: nobody to serve
        core.abort_all()
        core.shutdown()
        return
    except BaseException as exc:  # never die silently
        logger.exception("the engine-core loop failed")
        reason = exc
    core.shutdown()
    outbox.put(("dead", None, _picklable(reason)))
    outbox.close()


def _loop(core: EngineCore, conn: Connection, outbox: _Outbox) -> None:
    stop: str | None = None
    while True:
        # block for a command only when idle; between steps take whatever has arrived
        if stop is None and not core.has_work():
            conn.poll(None)
        while conn.poll(0):
            kind, token, arg = conn.recv()
            if kind == "add":
                try:
                    outbox.put(("reply", token, core.add(arg)))
                except Exception as exc:  # noqa: BLE001 -- ValueError, QueueFull: the caller gets it
                    outbox.put(("error", token, _picklable(exc)))
            elif kind == "abort":
                core.abort(arg)
                if token is not None:
                    outbox.put(("reply", token, None))
            elif kind == "stats":
                outbox.put(("reply", token, core.prometheus_text()))
            elif kind == "label":
                core.set_metrics_label(*arg)
            elif kind == "stop_completion":
                core.stop_completion(*arg)
            elif kind == "stop":
                stop = "abort" if arg == "abort" or stop == "abort" else "finish"
        if stop == "abort":
            core.abort_all()
        if stop is not None and not core.has_work():
            return
        if core.has_work():
            core.step()


class ProcessCore:
    """The server side of the engine-core process (AsyncLLM's CoreClient). Starting it waits until the model is
    loaded (or raises the child's error)."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None,
                 deliver: Callable[[list[RequestOutput]], None], deliver_ids: Callable[[TokenDeltas], None],
                 die: Callable[[BaseException], None]) -> None:
        self._deliver, self._deliver_ids, self._die = deliver, deliver_ids, die
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = ctx.Pipe()
        # not a daemon: tensor-parallel workers are its children, and daemons may have none
        self._proc = ctx.Process(target=run_engine_core, args=(config, child_conn, max_waiting_requests),
                                 name="graphrunner-engine-core", daemon=False)
        self._proc.start()
        child_conn.close()  # so that a dead child reads as EOF here
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[str, concurrent.futures.Future[Any]]] = {}
        self._tokens = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        try:
            kind, _, arg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine-core process exited with code {self._proc.exitcode} while starting"
                               ) from None
        if kind != "ready":
            self._proc.join(30)
            if isinstance(arg, Exception):  # a bad model directory stays a ValueError (the CLI prints it cleanly)
                arg.add_note("(raised while the engine-core process started)")
                raise arg
            raise RuntimeError(f"the engine-core process could not start: {arg}")
        self._reader = threading.Thread(target=self._read, name="graphrunner-engine-core-reader", daemon=True)
        self._reader.start()

    # -- CoreClient --------------------------------------------------------------------------------
    def add(self, command: AddRequest, future: concurrent.futures.Future[str]) -> None:
        self._call("add", command, future)

    def abort(self, request_id: str, future: concurrent.futures.Future[Any] | None) -> None:
        if future is None:
            self._send(("abort", None, request_id))
        else:
            self._call("abort", request_id, future)

    def stop_completion(self, request_id: str, index: int, num_tokens: int, stop: str) -> None:
        self._send(("stop_completion", None, (request_id, index, num_tokens, stop)))

    def prometheus_text(self) -> str:
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._call("stats", None, future)
        return future.result(timeout=60)

    def set_metrics_label(self, name: str, value: str) -> None:
        self._send(("label", None, (name, value)))

    def is_alive(self) -> bool:
        return self._dead is None and not self._stopping and self._proc.is_alive()

    def shutdown(self, abort: bool, timeout: float | None) -> None:
        self._stopping = True
        self._send(("stop", None, "abort" if abort else "finish"))
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("the engine-core process did not stop within %s s: terminating it", timeout)
            self._proc.terminate()
            self._proc.join(10)
        self._reader.join(10)

    # -- plumbing ----------------------------------------------------------------------------------
    def _call(self, kind: str, arg: Any, future: concurrent.futures.Future[Any]) -> None:
        token = next(self._tokens)
        self._pending[token] = (kind, future)
        if not self._send((kind, token, arg)):
            self._pending.pop(token, None)
            _resolve(kind, future, EngineDead(f"the engine-core process is not running ({self._dead or 'shut down'})"))

    def _send(self, message: tuple[Any, str | int | None, Any]) -> bool:
        if self._dead is not None:
            return False
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, EOFError):  # the child is gone: the reader reports why
            return False

    def _read(self) -> None:
        reason: BaseException = EngineDead("the engine was shut down")
        try:
            while True:
                kind, token, arg = self._conn.recv()
                if kind == "ids":
                    self._deliver_ids(TokenDeltas(*arg))
                elif kind == "out":
                    self._deliver(decode_outputs(arg))
                elif kind in ("reply", "error"):
                    entry = self._pending.pop(token, None)
                    if entry is not None:
                        _resolve(entry[0], entry[1], arg if kind == "error" else None, arg)
                elif kind == "dead":
                    reason = arg
                    break
        except (EOFError, OSError):
            self._proc.join(5)
            if not self._stopping:
                reason = EngineDead(f"the engine-core process exited unexpectedly (exit code {self._proc.exitcode})")
                logger.error("%s", reason)
        except BaseException as exc:  # never die silently
            logger.exception("the engine-core reader failed")
            reason = exc
        self._dead = reason
        pending, self._pending = self._pending, {}
        for kind, future in pending.values():
            _resolve(kind, future, EngineDead(f"the engine-core process is not running ({reason})"))
        self._die(reason)


def _resolve(kind: str, future: concurrent.futures.Future[Any], error: BaseException | None,
             result: Any = None) -> None:
    """Settle a caller's future (one its caller cancelled is left alone); an abort never fails: the request is
    gone either way."""
    if not future.set_running_or_notify_cancel():
        return
    if error is not None and kind != "abort":
        future.set_exception(error)
    else:
        future.set_result(result)
