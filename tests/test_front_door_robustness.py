"""Robustness of the LLM front door: several threads (generate, stream) each receive exactly their own outputs;
closing or abandoning a stream aborts its requests; LLM.abort ends all n completions of a request; bad prompts,
sampling params and engine arguments are refused with a ValueError and harm nothing. Every test ends with
`assert_healthy` (see robustness_support.py).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
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
from tiny_models import hf_greedy

from graphrunner import LLM, SamplingParams
from graphrunner.outputs import RequestOutput
from graphrunner.sampling_params import RequestOutputKind

# -- 3. threads ------------------------------------------------------------------------------------
CALLS: list[tuple[list[list[int]], SamplingParams]] = [
    ([PROMPT, OTHER_PROMPTS[0]], _greedy(6)),
    ([OTHER_PROMPTS[1]], _greedy(11)),
    ([OTHER_PROMPTS[2], PROMPT[:4], [7] * 30], _greedy(5)),
    ([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True, seed=17, n=2)),
]


def _run_threads(targets: list[Callable[[], Any]]) -> list[Any]:
    """Run each target in its own thread, all released together; their results (exceptions re-raised)."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def body(i: int) -> None:
        try:
            start.wait()
            results[i] = targets[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


def test_concurrent_generates_each_get_their_own_outputs(llm: LLM, baseline: Baseline) -> None:
    sequential = [_tokens(llm.generate(prompts, params, use_tqdm=False)) for prompts, params in CALLS]
    results = _run_threads([lambda p=prompts, s=params: llm.generate(p, s, use_tqdm=False) for prompts, params in CALLS])
    for (prompts, _), outs, expected in zip(CALLS, results, sequential):
        assert [o.prompt_token_ids for o in outs] == prompts
        assert _tokens(outs) == expected
    ids = [o.request_id for outs in results for o in outs]
    assert len(ids) == len(set(ids))
    assert_healthy(llm, baseline)


def test_a_stream_and_a_generate_in_two_threads(llm: LLM, baseline: Baseline) -> None:
    stream_params = _greedy(12)
    expected_stream = _tokens(llm.generate([OTHER_PROMPTS[1]], stream_params, use_tqdm=False))[0][0]
    expected_gen = _tokens(llm.generate([PROMPT, OTHER_PROMPTS[2]], _greedy(10), use_tqdm=False))

    def stream() -> list[RequestOutput]:
        return list(llm.stream([OTHER_PROMPTS[1]], stream_params))

    def generate() -> list[RequestOutput]:
        return llm.generate([PROMPT, OTHER_PROMPTS[2]], _greedy(10), use_tqdm=False)

    streamed, generated = _run_threads([stream, generate])
    assert len({o.request_id for o in streamed}) == 1
    assert [len(o.outputs[0].token_ids) for o in streamed] == list(range(1, 13))
    assert streamed[-1].finished and streamed[-1].outputs[0].token_ids == expected_stream
    assert _tokens(generated) == expected_gen
    assert_healthy(llm, baseline)


# -- 4. streams ------------------------------------------------------------------------------------
def test_stream_yields_only_its_own_requests(llm: LLM, baseline: Baseline) -> None:
    prompts = [OTHER_PROMPTS[0], OTHER_PROMPTS[1]]
    expected = _tokens(llm.generate(prompts, _greedy(10), use_tqdm=False))
    it = llm.stream(prompts, _greedy(10))
    seen = [next(it)]
    between = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]  # steps the engine for the stream too
    assert between.outputs[0].token_ids == baseline.tokens
    seen += list(it)
    ids = {o.request_id for o in seen}
    assert len(ids) == 2 and between.request_id not in ids
    final = {o.request_id: o for o in seen if o.finished}
    assert [final[rid].prompt_token_ids for rid in sorted(final, key=int)] == prompts
    assert _tokens([final[rid] for rid in sorted(final, key=int)]) == expected
    assert_healthy(llm, baseline)


def _held(llm: LLM) -> tuple[int, int]:
    """(state rows in use, KV blocks in use)."""
    sched = llm.engine.scheduler
    return llm.config.scheduler.max_num_seqs - sched.rows.num_free, sched.pool.num_usable - sched.pool.num_free


def test_closing_a_stream_early_aborts_its_requests(llm: LLM, baseline: Baseline) -> None:
    it = llm.stream([PROMPT, OTHER_PROMPTS[2]], _greedy(60))
    first = next(it)
    assert _held(llm)[0] == 2 and _held(llm)[1] > 0
    it.close()
    assert _held(llm) == (0, 0)
    assert not llm.engine.has_request(first.request_id) and not llm._mailboxes
    assert_healthy(llm, baseline)


def test_abandoning_a_stream_aborts_its_requests(llm: LLM, baseline: Baseline) -> None:
    it: Iterator[RequestOutput] | None = llm.stream([PROMPT, OTHER_PROMPTS[2]], _greedy(60))
    assert it is not None
    next(it)
    assert _held(llm)[0] == 2
    del it
    gc.collect()
    assert _held(llm) == (0, 0)
    assert not llm._mailboxes
    assert_healthy(llm, baseline)


class _Cycle:
    """Holds a stream in a reference cycle, so only the cyclic garbage collector finalises it."""

    def __init__(self, stream: Iterator[RequestOutput]) -> None:
        self.stream = stream
        self.me = self


def test_a_stream_collected_by_gc_inside_a_step_is_aborted_safely(llm: LLM, baseline: Baseline,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython's cyclic GC may run at any allocation, also inside engine.step() on the thread that holds the
    (re-entrant) lock: the stream's abort must not change the scheduler's lists in the middle of a step."""
    # 15 prompt tokens: the stream's next decode step (the first step of the generate below) needs a new block
    box = _Cycle(llm.stream([[42] * 15], _greedy(60)))
    next(box.stream)
    del box  # garbage now, but only the cyclic collector will notice
    pool = llm.engine.scheduler.pool
    original = pool.allocate
    fired = [False]

    def allocate(count: int) -> list[int] | None:
        if count and not fired[0]:  # mid-schedule, while the stream's request is being given a block
            fired[0] = True
            gc.collect()
        return original(count)

    monkeypatch.setattr(pool, "allocate", allocate)
    out = llm.generate([baseline.prompt], GREEDY, use_tqdm=False)[0]
    assert fired[0]
    monkeypatch.undo()
    assert out.outputs[0].token_ids == baseline.tokens
    state = llm.engine.runner.state
    assert int(state.num_computed[state.padding_row]) == 0 and int(state.num_tokens[state.padding_row]) == 1
    assert_healthy(llm, baseline)


# -- 5. abort ------------------------------------------------------------------------------------
def test_abort_unknown_id_raises(llm: LLM, baseline: Baseline) -> None:
    with pytest.raises(ValueError, match="no running request with id 'nope'"):
        llm.abort("nope")
    assert_healthy(llm, baseline)


def test_abort_a_parent_ends_all_its_completions(llm: LLM, baseline: Baseline) -> None:
    rid = llm.engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    llm.engine.step()
    llm.engine.step()
    assert _held(llm)[0] == 3
    out = llm.abort(rid)
    assert out.finished and out.request_id == rid
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert _held(llm) == (0, 0)
    with pytest.raises(ValueError, match="no running request"):
        llm.abort(rid)  # finished: unknown now
    with pytest.raises(ValueError, match="no running request"):
        llm.abort(f"{rid}-0")  # a completion is not a request
    assert_healthy(llm, baseline)


def test_abort_reaches_a_stream_of_n_completions(llm: LLM, baseline: Baseline) -> None:
    it = llm.stream([PROMPT], SamplingParams(n=3, temperature=0.0, max_tokens=50, ignore_eos=True))
    first = next(it)
    llm.abort(first.request_id)
    rest = list(it)
    assert rest and rest[-1].finished and [c.finish_reason for c in rest[-1].outputs] == ["abort"] * 3
    assert _held(llm) == (0, 0)
    assert_healthy(llm, baseline)


def test_abort_reaches_a_generate_in_another_thread(llm: LLM, baseline: Baseline,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ready, resume = threading.Event(), threading.Event()
    original = llm._collect
    calls = [0]

    def collect(ids: set[str]) -> list[RequestOutput]:  # between two steps, outside the lock: pause once
        out = original(ids)
        calls[0] += 1
        if calls[0] == 4:
            ready.set()
            assert resume.wait(timeout=300)
        return out

    monkeypatch.setattr(llm, "_collect", collect)
    result: list[RequestOutput] = []
    worker = threading.Thread(target=lambda: result.extend(llm.generate([PROMPT], _greedy(100), use_tqdm=False)))
    worker.start()
    assert ready.wait(timeout=300)
    (rid,) = llm._mailboxes
    llm.abort(rid)
    resume.set()
    worker.join(timeout=300)
    assert not worker.is_alive()
    monkeypatch.undo()
    assert len(result) == 1 and result[0].request_id == rid
    out = result[0].outputs[0]
    assert out.finish_reason == "abort" and 2 <= len(out.token_ids) < 100
    assert out.token_ids == baseline.tokens[:len(out.token_ids)]
    assert_healthy(llm, baseline)


# -- 6. validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (None, "prompts must be a prompt or a list of prompts, got NoneType"),
        (5, "prompts must be a prompt or a list of prompts, got int"),
        (3.5, "prompts must be a prompt or a list of prompts, got float"),
        ([1, "a"], "token ids must all be integers"),
        ([1, True], "token ids must all be integers"),
        ([[1, "a"]], r"prompt token ids must be integers in \[0, 512\)"),
        ({"prompt_token_ids": 5}, "prompt_token_ids must be a list of integers, got int"),
        ({"foo": 1}, r"unknown prompt dict keys \['foo'\]"),
        ({"prompt": 5}, "a prompt must be a string, a list of token ids or a prompt dict, got int"),
        (b"bytes", "prompts must be a prompt or a list of prompts, got bytes"),
        ([b"bytes"], "a prompt must be a string, a list of token ids or a prompt dict, got bytes"),
        ([[]], "the prompt is empty"),
        ({"prompt_token_ids": []}, "the prompt is empty"),
        ([PROMPT, [1, 2**40]], r"prompt token ids must be integers in \[0, 512\)"),
    ],
)
def test_bad_prompts_are_refused(llm: LLM, baseline: Baseline, prompts: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert_healthy(llm, baseline)


def test_no_prompts_give_no_outputs(llm: LLM, baseline: Baseline) -> None:
    """As vLLM: an empty list of prompts is zero requests, not an error (an empty prompt is, above)."""
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert list(llm.stream([], GREEDY)) == []
    assert_healthy(llm, baseline)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ("greedy", "sampling_params must be a SamplingParams or a list of them, got str"),
        (0.0, "sampling_params must be a SamplingParams or a list of them, got float"),
        ([GREEDY], "got 1 sampling params for 2 prompts"),
        ([GREEDY, GREEDY, GREEDY], "got 3 sampling params for 2 prompts"),
        ([GREEDY, {"temperature": 0}], "sampling params must be a SamplingParams, got dict"),
    ],
)
def test_bad_sampling_params_are_refused(llm: LLM, baseline: Baseline, params: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPT, OTHER_PROMPTS[0]], params, use_tqdm=False)
    assert_healthy(llm, baseline)


def test_huge_top_k_is_off_and_tiny_temperature_is_greedy(llm: LLM, baseline: Baseline) -> None:
    def seeded(**kw: Any) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3, **kw)
        return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)

    off = seeded(top_k=-1)
    assert seeded(top_k=2**40) == off == seeded(top_k=0) == seeded(top_k=512)
    assert seeded(top_k=2) != off  # the filter does act when it is inside the vocabulary
    tiny = SamplingParams(temperature=1e-7, max_tokens=8, ignore_eos=True)
    assert llm.generate([PROMPT], tiny, use_tqdm=False)[0].outputs[0].token_ids == baseline.tokens
    assert_healthy(llm, baseline)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bogus": 1}, r"unknown engine argument\(s\) \['bogus'\]"),
        ({"trust_remote_code": True}, "trust_remote_code=True"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not fit the model: num_attention_heads=4"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"compilation_config": {"cudagraph_mode": "bogus"}}, "cudagraph_mode 'bogus'"),
        ({"compilation_config": "O3"}, "compilation_config must be a level"),
        ({"compilation_config": {"cudagraph_capture_sizes": [1, 0]}}, "cudagraph_capture_sizes must be a list"),
        ({"compilation_config": {"cudagraph_capture_sizes": 8}}, "cudagraph_capture_sizes must be a list"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
         r"without chunked prefill max_num_batched_tokens \(64\) must be >= max_model_len \(128\)"),
    ],
)
def test_bad_engine_arguments_are_refused(model_dir: Path, llm: LLM, baseline: Baseline, kwargs: dict[str, Any],
                                          match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=128, **kwargs)
    assert_healthy(llm, baseline)


@pytest.mark.parametrize(("kwargs", "match"), [({"attention_backend": "triton"}, "attention_backend='triton' on CPU"),
                                               ({"use_triton": True}, "use_triton=True on CPU")])
def test_triton_on_cpu_without_the_interpreter_is_refused(model_dir: Path, llm: LLM, baseline: Baseline,
                                                          kwargs: dict[str, Any], match: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels on CPU tensors run only under Triton's interpreter: without it the engine refuses at
    construction (a clear error) instead of failing inside the first kernel launch."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=match + r" needs TRITON_INTERPRET=1"):
        LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=128, device="cpu", **kwargs)
    assert_healthy(llm, baseline)


def test_a_hub_id_is_refused_without_downloading(llm: LLM, baseline: Baseline) -> None:
    with pytest.raises(ValueError, match="'Qwen/Qwen3-0.6B' is not a local directory; graphrunner downloads nothing"):
        LLM(model="Qwen/Qwen3-0.6B")
    assert_healthy(llm, baseline)


@pytest.fixture(scope="module")
def unchunked(model_dir: Path) -> LLM:
    """A second engine: no chunked prefill (default batch budget), compilation level 0, max_logprobs=2."""
    return LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=128, enable_chunked_prefill=False,
               compilation_config=0, max_logprobs=2)


def test_unchunked_eager_engine_matches_hf(unchunked: LLM, model_dir: Path, llm: LLM, baseline: Baseline) -> None:
    assert unchunked.config.enforce_eager and not unchunked.config.scheduler.enable_chunked_prefill
    assert unchunked.config.scheduler.max_num_batched_tokens >= 128
    prompts = [PROMPT, list(range(3, 103)), OTHER_PROMPTS[1]]
    outs = unchunked.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 8)
    assert outs[0].outputs[0].token_ids == baseline.tokens
    assert_healthy(unchunked, baseline)
    assert_healthy(llm, baseline)


def test_max_logprobs_is_enforced(unchunked: LLM, baseline: Baseline) -> None:
    with pytest.raises(ValueError, match="requested logprobs=3, more than max_logprobs=2"):
        unchunked.generate([PROMPT], _greedy(4, logprobs=3), use_tqdm=False)
    with pytest.raises(ValueError, match="requested prompt_logprobs=3, more than max_logprobs=2"):
        unchunked.generate([PROMPT], _greedy(4, prompt_logprobs=3), use_tqdm=False)
    out = unchunked.generate([PROMPT], _greedy(4, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == baseline.tokens[:4] and all(len(lp) <= 3 for lp in out.logprobs)
    assert_healthy(unchunked, baseline)


def test_llm_engine_final_only_id_reused_after_an_llm_abort(llm: LLM, baseline: Baseline) -> None:
    """A FINAL_ONLY request added through llm.llm_engine but ended by llm.abort: its id, used again for a
    cumulative request, reports every intermediate output."""
    engine = llm.llm_engine
    engine.add_request("q", PROMPT, _greedy(8, output_kind=RequestOutputKind.FINAL_ONLY))
    engine.step()
    assert llm.abort("q").outputs[0].finish_reason == "abort"
    engine.add_request("q", PROMPT, GREEDY)
    seen: list[int] = []
    while engine.has_unfinished_requests():
        seen += [len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "q"]
    assert seen == list(range(1, 9))
    assert_healthy(llm, baseline)
