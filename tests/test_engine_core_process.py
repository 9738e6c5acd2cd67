"""AsyncLLM over a real tiny model, with the engine loop in a thread and in its own process: the merged delta
outputs equal LLM.generate's (tokens, text, stop strings, logprobs, prompt logprobs, n > 1 with seeds); bad input
raises in the caller; closing a stream aborts in the engine; a killed engine-core process ends every stream with
EngineDead (never a hang), and shutdown stops the process with exit code 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.async_llm import AsyncLLM, EngineDead
from graphrunner.engine_args import EngineArgs
from graphrunner.outputs import RequestOutput

PROMPTS = [[11, 22, 33, 44, 55, 66, 77], [5, 9, 13, 17], [101, 7, 64, 3, 3, 90, 45, 12, 8]]
ENGINE = {"num_gpu_blocks_override": 128, "max_model_len": 128}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("core_process"), "Qwen3ForCausalLM")


def _params(offline: LLM) -> list[SamplingParams]:
    """Greedy, seeded n=2 with logprobs, prompt logprobs, and a stop string cut from the greedy text."""
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    text = offline.generate([PROMPTS[0]], greedy)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"the greedy text {text!r} has no usable stop string"
    return [greedy,
            SamplingParams(temperature=0.9, top_k=20, seed=3, n=2, max_tokens=16, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])]


def _lps(entries: list[Any] | None) -> Any:
    """Logprob dicts as {token: value}: ids compared exactly, values within 1e-4 (batched CPU matmuls differ in
    the last bits from one-request batches)."""
    if entries is None:
        return None
    return [None if e is None else {t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in e.items()} for e in entries]


def _view(out: RequestOutput) -> Any:
    comps = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
              None if c.cumulative_logprob is None else pytest.approx(c.cumulative_logprob, abs=1e-3),
              _lps(c.logprobs)) for c in out.outputs]
    return out.prompt_token_ids, out.finished, comps, _lps(out.prompt_logprobs)


async def _last(llm: AsyncLLM, prompt: Any, params: SamplingParams, rid: str) -> RequestOutput:
    last = None
    async for out in llm.generate(prompt, params, rid):
        last = out
    assert last is not None
    return last


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_async_outputs_equal_offline(model_dir: Path, engine_process: bool) -> None:
    offline = LLM(model=model_dir, **ENGINE)
    all_params = _params(offline)
    expected = [_view(offline.generate([p], params)[0]) for params in all_params for p in PROMPTS]
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), **ENGINE), engine_process=engine_process)
    try:
        async def run_all() -> list[RequestOutput]:
            jobs = [_last(llm, p, params, f"r{i}-{j}") for i, params in enumerate(all_params)
                    for j, p in enumerate(PROMPTS)]
            return list(await asyncio.gather(*jobs))

        got = [_view(o) for o in asyncio.run(run_all())]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"request {i}"
        assert len(got) == len(expected)

        async def bad() -> None:
            with pytest.raises(ValueError, match="max_model_len|context|longer"):
                await _last(llm, [3] * 500, SamplingParams(max_tokens=4), "too-long")
            # the engine goes on serving
            assert (await _last(llm, PROMPTS[1], all_params[0], "after")).outputs[0].token_ids == expected[1][2][0][2]

        asyncio.run(bad())
    finally:
        llm.shutdown()
    if engine_process:
        assert llm._core._proc.exitcode == 0  # type: ignore[attr-defined]


def _running(llm: AsyncLLM) -> float:
    line = next(ln for ln in llm.prometheus_text().splitlines() if ln.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


def test_process_abort_on_close_then_kill_ends_streams(model_dir: Path) -> None:
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), **ENGINE), engine_process=True)
    try:
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

        async def first_then_close() -> None:
            gen = llm.generate(PROMPTS[0], long, "closed")
            await gen.__anext__()
            await gen.aclose()

        asyncio.run(first_then_close())
        for _ in range(200):  # the abort reaches the engine at its next step boundary
            if _running(llm) == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert _running(llm) == 0
        assert 'finished_reason="abort"} 1.0' in llm.prometheus_text()

        async def killed() -> None:
            gen = llm.generate(PROMPTS[1], long, "victim")
            await gen.__anext__()
            os.kill(llm._core._proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            with pytest.raises(EngineDead, match="exited unexpectedly"):
                async for _ in gen:
                    pass
            with pytest.raises(EngineDead):
                await _last(llm, PROMPTS[2], long, "later")

        asyncio.run(asyncio.wait_for(killed(), 60))
        assert not llm.is_running
    finally:
        llm.shutdown(timeout=10)


def test_process_start_failure_raises_the_engine_error(model_dir: Path, tmp_path: Path) -> None:
    """Weights that fail to load in the engine-core process give the caller the same ValueError as in-process."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="safetensors"):
        AsyncLLM.from_engine_args(EngineArgs(model=str(broken), **ENGINE), engine_process=True)


def test_wire_format_round_trips() -> None:
    """The engine-core process sends outputs as tuples; decoding gives back equal RequestOutputs."""
    from graphrunner.engine_core_process import decode_outputs, encode_outputs
    from graphrunner.metrics import RequestMetrics
    from graphrunner.outputs import CompletionOutput, Logprob

    lp = [{7: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, None)}]
    outs = [RequestOutput("a", "hi", [1, 2], [CompletionOutput(0, "", [7], -0.5, lp, None, None),
                                              CompletionOutput(1, "", [], None, None, "stop", 3)],
                          False, [None, {2: Logprob(-2.0, 4, "b")}], RequestMetrics(1.0, 2.0, 1.5, 2.0, 0.5, None), 16),
            RequestOutput("b", None, [], [CompletionOutput(0, "", [4, 5], None, None, "length", None)], True)]
    assert decode_outputs(encode_outputs(outs)) == outs


def test_loop_stats_count_the_time_blocked_on_results(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's wait counter is the time engine.step() spent in AsyncStepOutput.result(): with each result made
    to take 20 ms it reads at least that per processed step, never more than the step time itself."""
    import time

    from graphrunner.async_output import AsyncStepOutput
    from graphrunner.engine_core import AddRequest, EngineCore

    llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=2, enforce_eager=True)
    original = AsyncStepOutput.result

    def slow(self: AsyncStepOutput) -> Any:
        time.sleep(0.02)
        return original(self)

    monkeypatch.setattr(AsyncStepOutput, "result", slow)
    emitted: list[RequestOutput] = []
    core = EngineCore(llm.engine, None, emitted.extend)
    core.add(AddRequest({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=5, ignore_eos=True), "w"))
    while core.has_work():
        core.step()
    stats = core.loop_stats
    processed = stats.steps - 1  # the first step only launches
    assert emitted and emitted[-1].finished and len(emitted[-1].outputs[0].token_ids) >= 1
    assert stats.wait_s >= 0.02 * processed and stats.wait_s <= stats.step_s
    assert f"graphrunner:engine_loop_wait_seconds_total {stats.wait_s}" in stats.prometheus_text()
