"""Shared pieces of the engine robustness tests (a helper module, not a test file): one tiny CPU Qwen3 per
test module, its greedy baseline, and `assert_healthy` (the baseline still holds and nothing is left behind)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.outputs import RequestOutput

PROMPT = [11, 22, 33, 44, 55, 66, 77]
OTHER_PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 50, 60, 70, 80, 90], [42] * 16]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@dataclass(frozen=True)
class Baseline:
    prompt: list[int]
    tokens: list[int]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("robustness"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=128)


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> Baseline:
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    return Baseline(PROMPT, list(out.token_ids))


_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def assert_idle(llm: LLM) -> None:
    """No request, state row, KV block or mailbox is held."""
    engine = llm.engine
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.rows.num_free == llm.config.scheduler.max_num_seqs
    assert sched.pool.num_free == sched.pool.num_usable
    assert not engine._parents and not llm._mailboxes and not llm.llm_engine._final_only
    assert engine.stats.num_tracked_requests == 0
    gauges = {m.name: m.value for m in llm.get_metrics() if m.name in _GAUGES}  # type: ignore[attr-defined]
    assert gauges == dict.fromkeys(_GAUGES, 0.0)


def assert_healthy(llm: LLM, baseline: Baseline) -> None:
    """The engine serves the known greedy request with unchanged tokens and is left idle."""
    out = llm.generate([baseline.prompt], GREEDY, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == baseline.tokens
    assert not llm.engine.has_unfinished()
    assert_idle(llm)


def fail_on_call(fn: Callable[..., Any], at: int, exc: BaseException) -> Callable[..., Any]:
    """`fn`, except that its `at`-th call raises `exc` (a plain function: it also binds as a method)."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise exc
        return fn(*args, **kwargs)

    wrapper.calls = calls  # type: ignore[attr-defined]
    return wrapper


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


