"""Tensor parallelism when a rank dies: the engine ends with an error naming the worker, at once and on every
later step (never a hang), and the process can start a new tensor-parallel engine afterwards. CPU (gloo)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.engine import StepFailed
from graphrunner.tp_executor import collective_timeout_s

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ENGINE = {"max_model_len": 128, "num_gpu_blocks_override": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-faults"), "Qwen2ForCausalLM")


def test_a_killed_worker_ends_the_engine_with_a_clear_error(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHRUNNER_TP_TIMEOUT_S", "60")  # the bound if the death were not noticed sooner
    llm = LLM(model=model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)]
        engine = llm.engine
        engine.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY, request_id="r")
        for _ in range(3):
            engine.step()
        (pid,) = engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StepFailed) as failed:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 30
        cause = failed.value.__cause__
        assert cause is not None and f"tensor-parallel worker rank 1 (pid {pid}) exited with code -9" in str(cause)
        assert [o.outputs[0].finish_reason for o in failed.value.outputs] == ["error"]
        # every later step fails at once with the same reason
        with pytest.raises(StepFailed, match=r"worker rank 1 .* exited with code -9"):
            llm.generate([[4, 5]], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    # the process group was left: a new tensor-parallel engine starts and serves
    again = LLM(model=model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        launch, launches = again.engine.runner.execute, []
        again.engine.runner.execute = lambda sched: launches.append(sched) or launch(sched)  # wraps the executor's
        assert [o.outputs[0].token_ids for o in again.generate([[1, 2, 3]], GREEDY, use_tqdm=False)] == expected
        assert len(launches) >= GREEDY.max_tokens
    finally:
        again.engine.shutdown()
    assert all(not _alive(p) for p in (pid, *again.engine.runner.worker_pids))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("raw", ["soon", "0", "-3"])
def test_a_bad_collective_timeout_is_refused(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHRUNNER_TP_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="GRAPHRUNNER_TP_TIMEOUT_S must be"):
        collective_timeout_s()
