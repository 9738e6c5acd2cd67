"""The async front's merged stream (graphrunner/output_stream.py) and the engine's stop_completion: token-id
deltas become the same text tokenizer.decode gives; a stop string is cut where it completes, even inside a
several-token delta, with the later tokens and logprobs dropped and the engine told where; text that may still
become a stop string is held back; one of n completions can stop while the other runs on. vLLM's DELTA outputs
(LLMEngine and AsyncLLM) join to the cumulative output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
from tiny_models import make_tiny_model, tiny_tokenizer

from graphrunner import SamplingParams
from graphrunner.async_llm import AsyncLLM
from graphrunner.engine import Engine
from graphrunner.engine_args import EngineArgs
from graphrunner.llm_engine import LLMEngine
from graphrunner.output_stream import MergedStream
from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput
from graphrunner.sampling_params import RequestOutputKind

TEXT = "The weather was cold, the tea was warm, and the story was long."
PROMPT = [5, 6, 7]


def _delta(tokens: list[list[int]], first: bool, finish: list[str | None] | None = None,
           logprobs: bool = False) -> RequestOutput:
    finish = finish or [None] * len(tokens)
    comps = [CompletionOutput(i, "", list(t), cumulative_logprob=-1.0 * len(t) if logprobs else None,
                              logprobs=[{x: Logprob(-1.0 - 0.01 * x, 1)} for x in t] if logprobs else None,
                              finish_reason=f) for i, (t, f) in enumerate(zip(tokens, finish))]
    return RequestOutput("r", "p" if first else None, PROMPT if first else [], comps,
                         finished=all(f is not None for f in finish))


def test_text_equals_decode_and_length_finish_flushes() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    m = MergedStream(SamplingParams(max_tokens=len(ids)), tok)
    m.add(_delta([ids[:3]], True))
    for i in range(3, len(ids) - 1, 4):
        m.add(_delta([ids[i:min(i + 4, len(ids) - 1)]], False))
        out = m.output()
        assert TEXT.startswith(out.outputs[0].text) and not out.finished
    m.add(_delta([ids[-1:]], False, ["length"]))
    out = m.output()
    assert out.finished and out.outputs[0].text == tok.decode(ids) and out.outputs[0].token_ids == ids
    assert out.prompt_token_ids == PROMPT and m.pending_stops == []


def test_stop_string_inside_a_multi_token_delta_cuts_tokens_and_logprobs() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    stop = "tea"
    m = MergedStream(SamplingParams(max_tokens=100, stop=[stop], logprobs=1), tok)
    m.add(_delta([ids[:2]], True, logprobs=True))
    shown = tok.decode(ids[:2])
    assert m.output().outputs[0].text == shown[:len(shown) - (len(stop) - 1)]  # may yet become "tea": held back
    m.add(_delta([ids[2:]], False, logprobs=True))  # the whole rest at once: the stop is inside it
    out = m.output()
    comp = out.outputs[0]
    assert out.finished and comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == TEXT[:TEXT.index(stop)]
    cut = len(comp.token_ids)
    assert comp.token_ids == ids[:cut] and stop in tok.decode(ids[:cut]) and stop not in tok.decode(ids[:cut - 1])
    assert len(comp.logprobs) == cut
    assert comp.cumulative_logprob == pytest.approx(sum(-1.0 - 0.01 * t for t in ids[:cut]))
    assert m.pending_stops == [(0, cut, stop)]
    m.add(_delta([[1, 2, 3]], False, ["length"], logprobs=True))  # the engine's tokens made before it heard
    assert m.output().outputs[0].token_ids == ids[:cut] and m.output().outputs[0].finish_reason == "stop"


def test_one_of_two_completions_stops_the_other_runs_on() -> None:
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    m = MergedStream(SamplingParams(n=2, max_tokens=100, stop=["cold"]), tok)
    m.add(_delta([ids[:8], ids[-8:]], True))
    assert m.completions[0].finished and not m.completions[1].finished and not m.finished
    m.add(_delta([[], [0]], False, [None, "stop"]))
    assert m.finished and [c.finish_reason for c in m.output().outputs] == ["stop", "stop"]
    assert m.output().outputs[1].stop_reason is None  # the engine's own reason (a stop token) is kept


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model = make_tiny_model(tmp_path_factory.mktemp("stream"), "Qwen3ForCausalLM")
    return Engine(EngineArgs(model=str(model), num_gpu_blocks_override=64, max_model_len=128).create_engine_config())


def test_engine_stop_completion_keeps_tokens_frees_and_counts_stop(engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, n=2, seed=1)
    rid = engine.add_request([11, 22, 33], params, "s", delta=True, detokenize=False)
    reported: list[int] = []
    while len(reported) < 6:
        for out in engine.step():
            reported += out.outputs[0].token_ids
    assert engine.stop_completion(rid, 0, 3, "xyz") is None  # completion 1 still runs
    final = engine.stop_completion(rid, 1, 2, "abc")
    assert final is not None and final.finished
    assert [c.finish_reason for c in final.outputs] == ["stop", "stop"]
    assert [c.stop_reason for c in final.outputs] == ["xyz", "abc"]
    while engine.has_unfinished():  # the steps in flight drain; nothing more is reported for it
        assert all(o.request_id != rid for o in engine.step())
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_usable and not engine.scheduler.running
    assert 'finished_reason="stop"} 1.0' in engine.stats.to_prometheus_text()
    assert engine.stop_completion("unknown", 0, 1, "x") is None


def test_stop_completion_outside_the_range_is_ignored(engine: Engine) -> None:
    rid = engine.add_request([1, 2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), "t",
                             delta=True, detokenize=False)
    assert engine.stop_completion(rid, 5, 1, "x") is None and engine.has_request(rid)
    while engine.has_unfinished():
        engine.step()
    assert not engine.has_request(rid)


def _concat(deltas: list[RequestOutput]) -> list[tuple[str, list[int], list[dict[int, float]] | None, str | None]]:
    """Per completion: the deltas' text, tokens and logprobs joined, and the last finish reason."""
    joined: dict[int, list] = {}
    for d in deltas:
        assert d.prompt_token_ids == PROMPT_IDS  # vLLM's DELTA outputs carry the prompt every time
        for c in d.outputs:
            acc = joined.setdefault(c.index, ["", [], None, None])
            acc[0] += c.text
            acc[1] += c.token_ids
            if c.logprobs is not None:
                acc[2] = (acc[2] or []) + [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs]
            acc[3] = c.finish_reason
    return [tuple(v) for _, v in sorted(joined.items())]


def _full(out: RequestOutput, approx: bool = True) -> list[tuple[str, list[int], list[dict] | None, str | None]]:
    """The output's completions, logprobs as pytest.approx: the two requests compared sit in different rows of
    one batch, and a CPU matmul may round a row's last bit differently (CI saw -2.26575 round both ways)."""
    def value(x: float) -> object:
        return pytest.approx(x, abs=1e-4) if approx else x

    return [(c.text, list(c.token_ids),
             None if c.logprobs is None else [{t: value(lp.logprob) for t, lp in e.items()} for e in c.logprobs],
             c.finish_reason) for c in out.outputs]


PROMPT_IDS = [11, 22, 33, 44, 55]


def _delta_params(engine: Engine, kind: RequestOutputKind) -> SamplingParams:
    """Greedy with logprobs, prompt logprobs and a stop string cut from the greedy text (so the stop is met)."""
    probe = engine.add_request(list(PROMPT_IDS), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                               "probe", final_only=True)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == probe:
                text = out.outputs[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1, prompt_logprobs=1,
                          stop=[stop], output_kind=kind)


def test_llm_engine_delta_outputs_join_to_the_cumulative_one(engine: Engine) -> None:
    llm_engine = LLMEngine(engine)
    delta_params = _delta_params(engine, RequestOutputKind.DELTA)
    full_params = dataclasses.replace(delta_params, output_kind=RequestOutputKind.CUMULATIVE)
    llm_engine.add_request("d", {"prompt_token_ids": list(PROMPT_IDS)}, delta_params)
    llm_engine.add_request("c", {"prompt_token_ids": list(PROMPT_IDS)}, full_params)
    deltas, final = [], None
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.request_id == "d":
                deltas.append(out)
            elif out.finished:
                final = out
    assert final is not None and len(deltas) > 2 and deltas[-1].finished
    assert _concat(deltas) == _full(final) and final.outputs[0].finish_reason == "stop"
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert not llm_engine._delta  # nothing left behind


def test_async_delta_outputs_join_to_the_cumulative_one(engine: Engine) -> None:
    delta_params = _delta_params(engine, RequestOutputKind.DELTA)
    full_params = dataclasses.replace(delta_params, output_kind=RequestOutputKind.CUMULATIVE)
    llm = AsyncLLM.from_engine(engine)
    try:
        async def run(params: SamplingParams, rid: str) -> list[RequestOutput]:
            return [o async for o in llm.generate({"prompt_token_ids": list(PROMPT_IDS)}, params, rid)]

        async def both() -> tuple[list[RequestOutput], list[RequestOutput]]:
            return await asyncio.gather(run(delta_params, "ad"), run(full_params, "ac"))

        deltas, fulls = asyncio.run(both())
    finally:
        llm.shutdown()
    assert deltas[-1].finished and _concat(deltas) == _full(fulls[-1])
    assert fulls[-1].outputs[0].finish_reason == "stop"
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])


def test_async_token_deltas_stream_as_request_outputs(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncLLM's loop reports the middle steps of plain requests (one completion, no logprobs) as TokenDeltas,
    ids only: the streams still give LLMEngine's outputs: DELTA pieces join to the cumulative output, a stop string
    is cut where it completes, a request without one runs to max_tokens."""
    with_stop = dataclasses.replace(_delta_params(engine, RequestOutputKind.CUMULATIVE), logprobs=None,
                                    prompt_logprobs=None)
    no_stop = dataclasses.replace(with_stop, stop=None)
    reference = LLMEngine(engine)
    for rid, params in (("ref-stop", with_stop), ("ref-plain", no_stop)):
        reference.add_request(rid, {"prompt_token_ids": list(PROMPT_IDS)}, params)
    expected: dict[str, RequestOutput] = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                expected[out.request_id] = out
    taken: list[int] = []
    real_take = engine.take_token_deltas

    def spy() -> object:
        deltas = real_take()
        if deltas is not None:
            taken.append(len(deltas))
        return deltas

    monkeypatch.setattr(engine, "take_token_deltas", spy)
    llm = AsyncLLM.from_engine(engine)
    try:
        async def run(params: SamplingParams, rid: str) -> list[RequestOutput]:
            return [o async for o in llm.generate({"prompt_token_ids": list(PROMPT_IDS)}, params, rid)]

        async def all_four() -> list[list[RequestOutput]]:
            return list(await asyncio.gather(
                run(with_stop, "c-stop"), run(no_stop, "c-plain"),
                run(dataclasses.replace(with_stop, output_kind=RequestOutputKind.DELTA), "d-stop"),
                run(dataclasses.replace(no_stop, output_kind=RequestOutputKind.DELTA), "d-plain")))

        c_stop, c_plain, d_stop, d_plain = asyncio.run(all_four())
    finally:
        llm.shutdown()
    assert sum(taken) > 0  # the engine did report token deltas
    assert _full(c_stop[-1], approx=False) == _full(expected["ref-stop"]) and c_stop[-1].outputs[0].finish_reason == "stop"
    assert _full(c_plain[-1], approx=False) == _full(expected["ref-plain"]) and len(c_plain[-1].outputs[0].token_ids) == 20
    assert _concat(d_stop) == _full(expected["ref-stop"]) and _concat(d_plain) == _full(expected["ref-plain"])
    assert len(d_plain) > 2  # streamed in several pieces
    for outs in (c_stop, c_plain):  # cumulative outputs only grow
        ids = [list(o.outputs[0].token_ids) for o in outs]
        assert all(b[:len(a)] == a for a, b in itertools.pairwise(ids))
