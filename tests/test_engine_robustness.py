"""Robustness of a step: a fault injected at every stage of a step (schedule, stage, prepare, forward, logits,
sampler, post-update, output copy, scheduler update, output processing, detokenization) ends the in-flight requests
with finish_reason "error", raises StepFailed from the injected error (KeyboardInterrupt as it is), and the engine
goes on serving; the engine reports exactly the requests a failed step carried.

Every test ends with `assert_healthy`: the known greedy request still gives the same tokens and nothing
(request, state row, KV block, mailbox) is left behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from robustness_support import (  # noqa: F401 (fixtures are found by name)
    GREEDY,
    OTHER_PROMPTS,
    PROMPT,
    Baseline,
    _greedy,
    _tokens,
    assert_healthy,
    assert_idle,
    baseline,
    fail_on_call,
    llm,
    model_dir,
)

import graphrunner.runner
from graphrunner import LLM
from graphrunner.detokenizer import DeferredDetokenizer
from graphrunner.engine import StepFailed
from graphrunner.outputs import RequestOutput
from graphrunner.sampling_params import RequestOutputKind

# -- 1. a fault at every stage of a step --------------------------------------------------------------
STAGES: dict[str, Callable[[LLM], tuple[Any, str]]] = {
    "scheduler.schedule": lambda llm: (llm.engine.scheduler, "schedule"),
    "runner._stage": lambda llm: (llm.engine.runner, "_stage"),
    "prepare_inputs": lambda llm: (graphrunner.runner, "prepare_inputs"),
    "runner.run_model": lambda llm: (llm.engine.runner, "run_model"),
    "model.compute_logits": lambda llm: (llm.engine.runner.model, "compute_logits"),
    "run_sampler": lambda llm: (graphrunner.runner, "run_sampler"),
    "runner._update": lambda llm: (llm.engine.runner, "_update"),
    "outputs.launch": lambda llm: (llm.engine.runner.outputs, "launch"),
    "scheduler.update": lambda llm: (llm.engine.scheduler, "update"),
    "output_processor.process": lambda llm: (llm.engine._outputs, "process"),
    # LLM.generate's requests (final-only, no stop strings) keep their tokens per step and decode once at the end
    "detokenizer.update": lambda llm: (DeferredDetokenizer, "update"),
}


def _inject(monkeypatch: pytest.MonkeyPatch, llm: LLM, stage: str, exc: BaseException, at: int = 3) -> Any:
    target, name = STAGES[stage](llm)
    wrapper = fail_on_call(getattr(target, name), at, exc)
    monkeypatch.setattr(target, name, wrapper)
    return wrapper


@pytest.mark.parametrize("stage", list(STAGES))
def test_fault_in_a_stage_ends_in_flight_requests_with_error(llm: LLM, baseline: Baseline, stage: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    injected = RuntimeError("injected")
    wrapper = _inject(monkeypatch, llm, stage, injected)
    prompts = [PROMPT, *OTHER_PROMPTS]
    with pytest.raises(StepFailed) as info:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert wrapper.calls[0] >= 3, "the fault fired mid-generation"
    assert info.value.__cause__ is injected
    failed = info.value.outputs
    assert len({o.request_id for o in failed}) == len(prompts)  # all four were running
    for out in failed:
        assert out.finished and [c.finish_reason for c in out.outputs] == ["error"]
        assert len(out.outputs[0].token_ids) < 8
    monkeypatch.undo()
    assert_healthy(llm, baseline)


@pytest.mark.parametrize("stage", list(STAGES))
def test_keyboard_interrupt_in_a_step_propagates_and_engine_recovers(llm: LLM, baseline: Baseline, stage: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, llm, stage, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, *OTHER_PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_fault_in_another_callers_step_reaches_a_stream_as_error(llm: LLM, baseline: Baseline,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose request is ended by a step that another caller ran gets a final "error" output."""
    it = llm.stream([OTHER_PROMPTS[0]], _greedy(30))
    first = next(it)
    _inject(monkeypatch, llm, "runner.run_model", RuntimeError("injected"), at=1)
    with pytest.raises(StepFailed):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    rest = list(it)
    assert rest and rest[-1].request_id == first.request_id and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "error"
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_keyboard_interrupt_in_another_callers_step_reaches_a_stream_as_error(
        llm: LLM, baseline: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above with KeyboardInterrupt: the stream's request was ended too and its final output must reach it
    (not a RuntimeError "never finished")."""
    it = llm.stream([OTHER_PROMPTS[0]], _greedy(30))
    first = next(it)
    _inject(monkeypatch, llm, "runner.run_model", KeyboardInterrupt(), at=1)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    rest = list(it)
    assert rest and rest[-1].request_id == first.request_id and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "error"
    monkeypatch.undo()
    assert_healthy(llm, baseline)


# -- 2. the engine itself ----------------------------------------------------------------------------
def _run_to_end(engine: Any) -> dict[str, RequestOutput]:
    """Step until nothing is left; the final output of every request that finished meanwhile."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return final


def test_engine_step_failure_errors_exactly_the_in_flight_requests(llm: LLM, baseline: Baseline,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    expected_late = llm.generate([OTHER_PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    running = [engine.add_request(p, _greedy(20)) for p in [PROMPT, *OTHER_PROMPTS[:2]]]
    engine.step()
    engine.step()
    late = engine.add_request(OTHER_PROMPTS[2], GREEDY)  # queued, not yet scheduled: not in flight
    injected = RuntimeError("injected")
    _inject(monkeypatch, llm, "scheduler.schedule", injected, at=1)
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert info.value.__cause__ is injected
    assert sorted(o.request_id for o in info.value.outputs) == sorted(running)
    for out in info.value.outputs:
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert not engine.has_request(out.request_id)
    monkeypatch.undo()
    assert engine.has_request(late)
    after = engine.add_request(baseline.prompt, GREEDY)  # added after the failure
    final = _run_to_end(engine)
    assert set(final) == {late, after}
    assert final[after].outputs[0].token_ids == baseline.tokens
    assert final[late].outputs[0].token_ids == expected_late
    assert_healthy(llm, baseline)


def test_engine_failure_while_processing_reports_the_previous_steps_requests(
        llm: LLM, baseline: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure while processing step N's results: step N's requests are in flight too. One that step N
    finished (max_tokens reached, so it is in no later step and no longer running) must still be reported
    and forgotten, not left in the engine forever."""
    engine = llm.engine
    short = engine.add_request(PROMPT, _greedy(3))
    longer = engine.add_request(OTHER_PROMPTS[0], _greedy(20))
    # process() runs from step 2 on: its 3rd call handles step 3's results, where `short` gets its 3rd token
    injected = RuntimeError("injected")
    _inject(monkeypatch, llm, "output_processor.process", injected, at=3)
    with pytest.raises(StepFailed) as info:
        for _ in range(10):
            engine.step()
    assert info.value.__cause__ is injected
    outs = {o.request_id: o for o in info.value.outputs}
    assert set(outs) == {short, longer}
    assert outs[longer].outputs[0].finish_reason == "error"
    assert outs[short].finished and outs[short].outputs[0].token_ids == baseline.tokens[:3]
    assert not engine.has_request(short) and not engine.has_request(longer)
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_engine_failure_after_a_preemption_reports_the_preempted_request(
        llm: LLM, baseline: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step N+1's schedule preempts a request whose token from step N is still in flight, then processing step
    N fails: the preempted request (waiting, in no running list, in no launched step) must end too; left
    waiting for a token that will never come it would block admission for good."""
    engine = llm.engine
    sched = engine.scheduler
    # 8 x (100 prompt + 28) tokens need 8 x 8 blocks of 16; the cache has 63: the decode crossing token 112 preempts
    ids = [engine.add_request([7 + i] * 100, _greedy(28)) for i in range(8)]
    before = sched.num_preemptions
    injected = RuntimeError("injected")
    original = sched.update

    def update(*args: Any, **kwargs: Any) -> Any:
        if sched.num_preemptions > before:
            raise injected
        return original(*args, **kwargs)

    monkeypatch.setattr(sched, "update", update)
    with pytest.raises(StepFailed) as info:
        for _ in range(40):
            engine.step()
    assert info.value.__cause__ is injected and sched.num_preemptions == before + 1
    assert sorted(o.request_id for o in info.value.outputs) == sorted(ids)
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in info.value.outputs)
    assert not engine.has_unfinished()
    monkeypatch.undo()
    assert_healthy(llm, baseline)


def test_llm_engine_step_failure_forgets_final_only_ids(llm: LLM, baseline: Baseline,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """LLMEngine: a FINAL_ONLY request ended by a failed step must not stay marked final-only, or a later
    request reusing its id would have its intermediate outputs hidden."""
    engine = llm.llm_engine
    final_only = _greedy(8, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("r", PROMPT, final_only)
    engine.step()
    _inject(monkeypatch, llm, "runner.run_model", RuntimeError("injected"), at=1)
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert [o.request_id for o in info.value.outputs] == ["r"]
    monkeypatch.undo()
    engine.add_request("r", PROMPT, GREEDY)  # the id is free again; cumulative outputs this time
    seen: list[int] = []
    while engine.has_unfinished_requests():
        seen += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert seen == list(range(1, 9))
    assert_healthy(llm, baseline)


