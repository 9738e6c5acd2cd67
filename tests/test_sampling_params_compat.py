"""SamplingParams behaves as vLLM's: top_k 0 / -1 / beyond the vocabulary are off, tiny temperatures are greedy,
bool shorthands for logprobs, seed=-1 unseeded and 2**63 refused, single-string bad_words, clear ValueErrors for
junk collections and non-bool flags, detokenize=False + stop refused, deep clone, RequestOutputKind and
from_optional. Engine tests share one tiny Qwen3 and end by checking a known greedy request is unchanged.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.sampling.batch import SampleEntry, build_sampling_batch, prepare_request_sampling
from graphrunner.sampling.filters import apply_filters_ref
from graphrunner.sampling_params import RequestOutputKind
from graphrunner.state_table import StateTable

PROMPT = [11, 22, 33, 44, 55, 66, 77]
N = 12
VOCAB = 512  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("compat"), "Qwen3ForCausalLM")
    return LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=128, dtype="float32")


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[int]:
    """A known greedy request, taken before any test's inputs; every engine test checks it still holds."""
    return _tokens(llm, temperature=0.0)


def _tokens(llm: LLM, **kw: object) -> list[int]:
    params = SamplingParams(max_tokens=N, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


def _still_serving(llm: LLM, baseline: list[int]) -> None:
    assert not llm.engine.has_unfinished()
    assert _tokens(llm, temperature=0.0) == baseline


# 1. top_k -------------------------------------------------------------------------------------------------------
def test_top_k_zero_minus_one_and_beyond_vocab_are_off(llm: LLM, baseline: list[int]) -> None:
    assert SamplingParams().top_k == 0  # vLLM's default
    off = _tokens(llm, temperature=1.0, seed=7, top_k=-1)
    assert len(off) == N
    for top_k in (0, VOCAB, VOCAB + 1, 2**31, 2**40):
        assert _tokens(llm, temperature=1.0, seed=7, top_k=top_k) == off, top_k
    for bad in (-2, -(2**40), 1.5, True, "5", None):
        with pytest.raises(ValueError, match="top_k"):
            SamplingParams(top_k=bad)  # type: ignore[arg-type]
    _still_serving(llm, baseline)


def test_top_k_beyond_vocab_is_resolved_off_and_staged_without_overflow() -> None:
    params = SamplingParams(temperature=1.0, top_k=2**40)
    data = prepare_request_sampling(params, VOCAB, (0,), None)
    assert data.top_k == 0
    assert prepare_request_sampling(SamplingParams(top_k=5), VOCAB, (0,), None).top_k == 5
    assert prepare_request_sampling(SamplingParams(top_k=-1), VOCAB, (0,), None).top_k == 0
    batch = build_sampling_batch([SampleEntry(0, params, data, 0)], torch.zeros(1, dtype=torch.int32),
                                 torch.device("cpu"))
    assert not batch.use_filters and batch.plain  # no filter stage for an "off" top_k
    state = StateTable(max_reqs=2, max_model_len=8, max_blocks_per_req=2, device=torch.device("cpu"),
                       use_triton=False)
    state.stage_new_row(0, [1, 2], 2, 0, params, seed=3)
    state.apply_staged()
    assert int(state.top_k[0]) == 2**31 - 1
    logits = torch.randn(1, VOCAB)
    kept = logits.clone()
    apply_filters_ref(kept, torch.zeros(1, dtype=torch.int32), state.top_k[:1], torch.ones(1), torch.zeros(1))
    assert torch.equal(kept, logits)  # >= the vocabulary filters nothing


# 2. tiny temperatures -------------------------------------------------------------------------------------------
def test_temperature_below_eps_is_greedy(llm: LLM, baseline: list[int]) -> None:
    p = SamplingParams(temperature=1e-7, top_p=0.5, top_k=5, min_p=0.3)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 1.0, 0, 0.0)
    assert _tokens(llm, temperature=1e-7) == baseline
    assert _tokens(llm, temperature=1e-7, seed=5, top_k=3, top_p=0.2) == baseline
    assert _tokens(llm, temperature=0) == baseline  # an int 0 too
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)  # vLLM's floor for tiny temperatures
    assert SamplingParams(temperature=0.5).temperature == 0.5
    _still_serving(llm, baseline)


# 3. logprobs bool shorthands ------------------------------------------------------------------------------------
def test_logprobs_true_means_one_and_false_none(llm: LLM, baseline: list[int]) -> None:
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs is None
    short = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
    as_bool = llm.generate([PROMPT], SamplingParams(logprobs=True, prompt_logprobs=True, **short))[0]  # type: ignore
    as_int = llm.generate([PROMPT], SamplingParams(logprobs=1, prompt_logprobs=1, **short))[0]  # type: ignore
    assert as_bool.outputs[0].logprobs == as_int.outputs[0].logprobs
    assert as_bool.outputs[0].logprobs is not None and len(as_bool.outputs[0].logprobs) == 3
    assert as_bool.prompt_logprobs is not None and as_bool.prompt_logprobs == as_int.prompt_logprobs
    without = llm.generate([PROMPT], SamplingParams(logprobs=False, **short))[0]  # type: ignore[arg-type]
    assert without.outputs[0].logprobs is None
    for name in ("n", "max_tokens", "min_tokens", "best_of", "truncate_prompt_tokens", "seed"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: True})
    _still_serving(llm, baseline)


# 4. seeds -------------------------------------------------------------------------------------------------------
def test_seed_range(llm: LLM, baseline: list[int]) -> None:
    assert SamplingParams(seed=-1).seed is None
    a, b = _tokens(llm, temperature=1.0, seed=-1), _tokens(llm, temperature=1.0, seed=-1)
    assert a != b  # unseeded: each request draws its own seed
    top = 2**63 - 1
    assert SamplingParams(seed=top).seed == top
    assert _tokens(llm, temperature=1.0, seed=top) == _tokens(llm, temperature=1.0, seed=top)
    for bad in (2**63, 2**64 - 1, -2, -(2**63), 1.0, "1", True):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            SamplingParams(seed=bad)  # type: ignore[arg-type]
    _still_serving(llm, baseline)


# 5. collections -------------------------------------------------------------------------------------------------
def test_single_bad_word_string_is_one_word(llm: LLM, baseline: list[int]) -> None:
    assert SamplingParams(bad_words="hello world").bad_words == ["hello world"]
    assert SamplingParams(bad_words=["a", "a", "b"]).bad_words == ["a", "b"]  # deduplicated, as vLLM
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop_token_ids=[3, 3, 1]).stop_token_ids == [3, 1]
    assert SamplingParams(bad_words=None).bad_words == []
    def text(**kw: object) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw)  # type: ignore[arg-type]
        return llm.generate(["The quick brown"], params)[0].outputs[0].token_ids

    greedy = text()
    word = llm.get_tokenizer().decode(greedy[2:4]).strip()
    assert word, "need a visible word to ban"
    assert text(bad_words=word) == text(bad_words=[word]) != greedy
    _still_serving(llm, baseline)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_token_ids": 5}, "stop_token_ids must be a list, got int 5"),
        ({"stop_token_ids": 0}, "stop_token_ids must be a list"),
        ({"stop_token_ids": {1: 2}}, "stop_token_ids must be a list, got dict"),
        ({"stop_token_ids": [1, None]}, r"stop_token_ids must hold non-negative integer token ids, got \[None\]"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids must hold"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must hold"),
        ({"stop_token_ids": [True]}, "stop_token_ids must hold"),
        ({"allowed_token_ids": 5}, "allowed_token_ids must be a list, got int 5"),
        ({"allowed_token_ids": {"a": 1}}, "allowed_token_ids must be a list"),
        ({"allowed_token_ids": [3, None]}, "allowed_token_ids must hold"),
        ({"allowed_token_ids": [2.5]}, "allowed_token_ids must hold"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"stop": 5}, "stop must be a list"),
        ({"stop": ["x", None]}, "stop must hold non-empty strings"),
        ({"stop": [""]}, "stop must hold non-empty strings"),
        ({"bad_words": {"x": 1}}, "bad_words must be a list"),
        ({"bad_words": [" "]}, "bad_words must hold non-empty, non-blank strings"),
        ({"bad_words": ["ok", 3]}, "bad_words must hold"),
        ({"logit_bias": {"a": 1.0}}, r"logit_bias keys must be integer token ids, got \['a'\]"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias keys must be integer token ids"),
        ({"logit_bias": {None: 1.0}}, "logit_bias keys must be integer token ids"),
        ({"logit_bias": {" 12": 1.0}}, "logit_bias keys must be integer token ids"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias must be a dict"),
        ({"logit_bias": {1: "x"}}, r"logit_bias\[1\] must be a finite number"),
    ],
)
def test_junk_collections_are_clear_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_string_logit_bias_keys_still_work(llm: LLM, baseline: list[int]) -> None:
    assert set(_tokens(llm, temperature=0.0, logit_bias={"123": 100.0})) == {123}
    _still_serving(llm, baseline)


# 6. boolean flags -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                                  "include_stop_str_in_output"])
@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_flags_must_be_bools(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    assert getattr(SamplingParams(**{name: True}), name) is True  # type: ignore[arg-type]


# 7. detokenize=False with stop strings --------------------------------------------------------------------------
def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(detokenize=False, stop="x")
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["a", "b"])
    assert SamplingParams(detokenize=False, stop_token_ids=[3]).stop == []  # stop token ids are fine


# 8. clone -------------------------------------------------------------------------------------------------------
def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[1], bad_words=["w"], logit_bias={1: 2.0}, allowed_token_ids=[3],
                       extra_args={"k": [1]})
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")  # type: ignore[union-attr]
    c.stop_token_ids.append(2)  # type: ignore[union-attr]
    c.bad_words.append("v")  # type: ignore[union-attr]
    c.logit_bias[5] = 1.0  # type: ignore[index]
    c.allowed_token_ids.append(4)  # type: ignore[union-attr]
    c.extra_args["k"].append(2)
    assert (p.stop, p.stop_token_ids, p.bad_words, p.logit_bias, p.allowed_token_ids, p.extra_args) == (
        ["a"], [1], ["w"], {1: 2.0}, [3], {"k": [1]})


# 9. output_kind -------------------------------------------------------------------------------------------------
def test_request_output_kind() -> None:
    assert [(k.name, k.value) for k in RequestOutputKind] == [("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA
    for bad in (1, "DELTA", None):
        with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
            SamplingParams(output_kind=bad)  # type: ignore[arg-type]


# 10. from_optional ----------------------------------------------------------------------------------------------
def test_from_optional() -> None:
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, top_k=None, presence_penalty=None,
                                     ignore_eos=None, output_kind=None, extra_args=None, stop=None, seed=None)
    assert p == SamplingParams()
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None  # None keeps its meaning (no limit)
    assert SamplingParams.from_optional(temperature=0.5, top_k=-1).temperature == 0.5
    q = SamplingParams.from_optional(logit_bias={"7": 300.0, 8: -250, 9: 1.5})
    assert q.logit_bias == {7: 100.0, 8: -100.0, 9: 1.5}  # int keys, clamped to [-100, 100] as vLLM
    with pytest.raises(ValueError, match="logit_bias keys must be integer token ids"):
        SamplingParams.from_optional(logit_bias={"x": 1.0})
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.from_optional(seed=2**64 - 1)
