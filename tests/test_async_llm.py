"""AsyncLLM's loop thread against a fake engine (no model): outputs reach their streams, bad input raises before
the first output, closing a stream aborts, QueueFull past the bound, StepFailed ends only its requests, any other
loop error ends every stream, and shutdown stops the thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from graphrunner.async_llm import AsyncLLM, EngineDead, QueueFull
from graphrunner.engine import StepFailed
from graphrunner.outputs import CompletionOutput, RequestOutput
from graphrunner.sampling_params import SamplingParams
from graphrunner.tp_workers import WorkerDied


class FakeEngine:
    """Each step adds one token to every request; a request finishes after params.max_tokens tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, list[Any]] = {}  # id -> [params, tokens, tokens reported, delta]
        self.scheduler = SimpleNamespace(waiting=[], running=[])
        self.stats = SimpleNamespace(to_prometheus_text=lambda: "x 1\n", labels={})
        self.tokenizer, self.config = None, SimpleNamespace()
        self.fail_next: BaseException | None = None
        self.steps = 0
        self.aborted: list[str] = []
        self.shut_down = False
        self.step_delay = 0.0  # seconds per step: a test racing the loop sets it so its request cannot finish first
        self.result_wait_s = 0.0  # Engine's counter of time blocked on results (this fake never waits)

    def report_token_deltas(self) -> None:  # this fake always reports RequestOutputs
        pass

    def take_token_deltas(self) -> None:
        return None

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, final_only: bool = False,
                    delta: bool = False, detokenize: bool = True) -> str:
        if prompt == "bad":
            raise ValueError("bad prompt")
        self.requests[request_id] = [params, [], 0, delta]
        self.scheduler.waiting.append(request_id)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def shutdown(self) -> None:
        self.shut_down = True

    def _out(self, rid: str, reason: str | None) -> RequestOutput:
        """As the Engine reports: the new tokens only (and the prompt in the first report) for a delta request."""
        entry = self.requests[rid]
        tokens, sent, delta = entry[1], entry[2], entry[3]
        new = tokens[sent:] if delta else list(tokens)
        entry[2] = len(tokens)
        comp = CompletionOutput(0, "t" * len(new), new, finish_reason=reason)
        first = sent == 0
        return RequestOutput(rid, "p" if first or not delta else None, [1] if first or not delta else [], [comp],
                             finished=reason is not None)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.step_delay:
            threading.Event().wait(self.step_delay)
        self.scheduler.waiting.clear()
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            if isinstance(exc, StepFailed):
                exc.outputs = [self._out(rid, "error") for rid in self.requests]
                self.requests.clear()
            raise exc
        outs = []
        for rid, (params, tokens, _, _) in list(self.requests.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            outs.append(self._out(rid, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, rid: str) -> RequestOutput | None:
        if rid not in self.requests:
            return None
        self.aborted.append(rid)
        out = self._out(rid, "abort")
        del self.requests[rid]
        return out


async def _all(llm: AsyncLLM, prompt: str = "p", n: int = 3, rid: str | None = None) -> list[RequestOutput]:
    return [o async for o in llm.generate(prompt, SamplingParams(max_tokens=n), rid)]


def test_slow_consumer_gets_the_newest_cumulative_output() -> None:
    """A consumer that falls behind skips outputs it has not read yet: each one it gets is the newest."""
    engine = FakeEngine()
    llm = AsyncLLM.from_engine(engine)

    async def slow() -> list[RequestOutput]:
        got = []
        async for out in llm.generate("p", SamplingParams(max_tokens=40)):
            got.append(out)
            await asyncio.sleep(0.02)  # the engine steps on meanwhile
        return got

    try:
        outs = asyncio.run(slow())
    finally:
        llm.shutdown()
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens[-1] == 40 and outs[-1].finished and lens == sorted(set(lens))
    assert len(outs) < 40  # some outputs were replaced by newer ones


def test_outputs_and_idle() -> None:
    engine = FakeEngine()
    llm = AsyncLLM.from_engine(engine)
    try:
        outs = asyncio.run(_all(llm))
        lens = [len(o.outputs[0].token_ids) for o in outs]
        # cumulative outputs; one a consumer had not yet read may be replaced by a newer one (as vLLM's)
        assert lens == sorted(set(lens)) and lens[-1] == 3 and outs[-1].finished
        steps = engine.steps
        threading.Event().wait(0.3)
        assert engine.steps == steps  # idle: no busy stepping
    finally:
        llm.shutdown()
    assert not llm._core._thread.is_alive()


def test_bad_input_queue_full_and_abort_on_close() -> None:
    engine = FakeEngine()
    llm = AsyncLLM.from_engine(engine, max_waiting_requests=1)
    try:
        with pytest.raises(ValueError, match="bad prompt"):
            asyncio.run(_all(llm, "bad"))
        with pytest.raises(QueueFull):  # n=2 sequences would wait: more than the bound
            asyncio.run(anext(llm.generate("p", SamplingParams(n=2))))

        # r1 would take 1,000 steps: the fake engine's loop, unpaced, could finish it before aclose() lands
        engine.step_delay = 0.002

        async def first_then_close() -> None:
            gen = llm.generate("p", SamplingParams(max_tokens=1000), "r1")
            await gen.__anext__()
            await gen.aclose()
            for _ in range(100):
                if "r1" in engine.aborted:
                    return
                await asyncio.sleep(0.02)

        asyncio.run(first_then_close())
        assert engine.aborted == ["r1"]
    finally:
        llm.shutdown()


def test_step_failed_goes_on_and_crash_ends_streams() -> None:
    engine = FakeEngine()
    llm = AsyncLLM.from_engine(engine)
    try:
        engine.fail_next = StepFailed("boom", [])
        outs = asyncio.run(_all(llm, n=5))
        assert outs[-1].outputs[0].finish_reason == "error"
        assert asyncio.run(_all(llm))[-1].outputs[0].finish_reason == "length"  # the loop went on
        engine.fail_next = RuntimeError("kaput")
        with pytest.raises(RuntimeError, match="kaput"):
            asyncio.run(_all(llm, n=5))
        with pytest.raises(EngineDead):
            asyncio.run(_all(llm))
        assert not llm.is_running
    finally:
        llm.shutdown()


def test_shutdown_aborts_in_flight() -> None:
    engine = FakeEngine()
    llm = AsyncLLM.from_engine(engine)

    async def run() -> RequestOutput:
        last = None
        async for out in llm.generate("p", SamplingParams(max_tokens=10**6), "r"):
            if last is None:
                threading.Thread(target=llm.shutdown).start()
            last = out
        return last

    assert asyncio.run(asyncio.wait_for(run(), 30)).outputs[0].finish_reason == "abort"
    llm._core._thread.join(10)
    assert not llm._core._thread.is_alive()
    assert engine.shut_down  # the engine's own shutdown (tensor-parallel workers) ran as the loop ended


def test_a_dead_tensor_parallel_worker_ends_the_loop() -> None:
    engine = FakeEngine()
    llm = AsyncLLM.from_engine(engine)
    try:
        failed = StepFailed("a step failed", [])
        failed.__cause__ = WorkerDied("tensor-parallel worker rank 1 (pid 7) exited with code -9")
        engine.fail_next = failed
        outs = []

        async def collect() -> None:
            async for out in llm.generate("p", SamplingParams(max_tokens=5), "r"):
                outs.append(out)

        asyncio.run(collect())  # the request's final output (finish_reason "error") still reaches its stream
        assert outs[-1].outputs[0].finish_reason == "error"
        llm._core._thread.join(10)  # the loop thread ends once it has shut the engine down
        assert not llm._core._thread.is_alive()
        assert not llm.is_running and engine.shut_down
        with pytest.raises(EngineDead, match="worker rank 1"):
            asyncio.run(_all(llm))
    finally:
        llm.shutdown()
