"""Engine behaviour on a tiny Qwen3: stop conditions, async token dropping, seeds, n > 1, text prompts,
and clear ValueErrors for bad input that leave the engine serving other requests.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams

PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("behaviour"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=model_dir, num_gpu_blocks_override=256, max_model_len=256)


def _greedy(llm: LLM, max_tokens: int = 24, **kw: object) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


def test_stop_token_ends_request_and_later_tokens_are_dropped(llm: LLM) -> None:
    full = _greedy(llm)
    stop = full[5]
    first = full.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]))[0].outputs[0]
    # the engine runs one step ahead; the token sampled after the stop token must never be emitted
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_min_tokens_masks_stop_tokens_like_hf(llm: LLM, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    full = _greedy(llm, 40)
    stop = full[1]
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=6, ignore_eos=True,
                                                stop_token_ids=[stop]))[0].outputs[0]
    assert stop not in out.token_ids[:6]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():  # HF's MinNewTokensLengthLogitsProcessor masks eos below min_new_tokens, as we do
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                          min_new_tokens=6, eos_token_id=stop, pad_token_id=stop)[0, len(PROMPT):].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == ("stop" if ref[-1] == stop else "length")


def test_eos_from_config_stops_unless_ignored(model_dir: Path, tmp_path: Path, llm: LLM) -> None:
    full = _greedy(llm)
    eos = full[3]
    copy = tmp_path / "eos_model"
    shutil.copytree(model_dir, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (copy / "config.json").write_text(json.dumps(cfg))
    other = LLM(model=copy, num_gpu_blocks_override=64, max_model_len=256)
    out = other.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == full[: full.index(eos) + 1] and out.finish_reason == "stop"
    ignored = other.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == full and ignored.outputs[0].finish_reason == "length"


def test_stop_string_is_excluded_from_text(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate([prompt], params)[0].outputs[0]
    decoded = tok.decode(full.token_ids, skip_special_tokens=True)
    # random weights emit broken UTF-8; a trailing incomplete character is held back, as in vLLM
    assert decoded.startswith(full.text) and set(decoded[len(full.text):]) <= {"\ufffd"}
    stop = full.text[8:11]
    assert stop.strip(), "pick a visible stop string"
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert cut.outputs[0].text == full.text[: full.text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.prompt == prompt and cut.prompt_token_ids == tok.encode(prompt)


def test_seeded_sampling_same_alone_and_in_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=1234)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20 + i, ignore_eos=True, seed=i) for i in range(7)]
    prompts = [[3 + i] * (5 + 4 * i) for i in range(7)]
    batch = llm.generate(prompts[:3] + [PROMPT] + prompts[3:], others[:3] + [seeded] + others[3:])
    assert batch[3].outputs[0].token_ids == alone
    # and the seed matters: a different one gives a different sample (20 tokens of 512 at T=1)
    assert llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=99))[
        0].outputs[0].token_ids != alone


def test_unseeded_runs_reproduce_with_the_engine_seed(model_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=256, seed=7).generate([PROMPT] * 3, params)
            for _ in range(2)]
    ids = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert ids[0] == ids[1]
    assert len({tuple(x) for x in ids[0]}) > 1, "each request draws its own seed"


def test_n_completions_have_distinct_seeds(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=16, ignore_eos=True, seed=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=16, ignore_eos=True, seed=5))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_streaming_yields_growing_outputs(llm: LLM) -> None:
    lengths = [len(o.outputs[0].token_ids) for o in
               llm.stream([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    assert lengths == [1, 2, 3, 4, 5, 6]


def test_final_only_requests_are_reported_once_with_the_same_result(llm: LLM) -> None:
    """A final-only request (how LLM.generate submits) is reported only when it finishes, with the output a
    cumulative request of the same seed and prompt ends with; a cumulative one beside it is reported every step
    with the text stop strings act on."""
    engine = llm.engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, stop=["zzz-never"])
    engine.add_request({"prompt_token_ids": [5, 6, 7, 8]}, params, request_id="final", final_only=True)
    engine.add_request({"prompt_token_ids": [5, 6, 7, 8]}, params, request_id="every")
    seen: dict[str, list] = {"final": [], "every": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished
    assert len(seen["every"]) >= 9 and seen["every"][-1].finished
    a, b = seen["final"][0].outputs[0], seen["every"][-1].outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 9 and a.text == b.text and a.text


def test_abort_mid_run_frees_resources(llm: LLM) -> None:
    engine = llm.engine
    free_before = engine.scheduler.pool.num_free
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(rid)
    while engine.has_unfinished():
        assert engine.step() == []
    assert engine.scheduler.pool.num_free == free_before
    assert _greedy(llm, 5) == _greedy(llm, 24)[:5]


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "empty"),
        ([1, -1], SamplingParams(), r"\[0, 512\)"),
        ([1, 512], SamplingParams(), r"\[0, 512\)"),
        ([1] * 256, SamplingParams(), "max_model_len"),
        ([1] * 200, SamplingParams(max_tokens=57), "exceeds max_model_len"),
        ([1, 2], SamplingParams(best_of=2), "not supported yet: best_of"),
        ([1, 2], SamplingParams(logit_bias={600: 1.0}), r"logit_bias contains token ids outside"),
        ([1, 2], SamplingParams(allowed_token_ids=[3, 512]), r"allowed_token_ids contains token ids outside"),
        ([1, 2], SamplingParams(stop_token_ids=[9999]), r"stop_token_ids contains token ids outside"),
        ("", SamplingParams(), "empty"),
        (3.5, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(llm: LLM, prompt: object, params: SamplingParams,
                                                     match: str) -> None:
    expected = _greedy(llm, 4)
    with pytest.raises(ValueError, match=match):
        # the bad prompt sits between two good ones: the whole batch is refused, nothing is left queued
        llm.generate([PROMPT, prompt, PROMPT], params)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished()
    assert _greedy(llm, 4) == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"n": 0}, "n must be"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_k": True}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_arguments(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        LLM(model=tmp_path / "missing")
    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(model_dir / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match="no_weights"):
        LLM(model=empty)
    odd = tmp_path / "odd_arch"
    shutil.copytree(model_dir, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPTNeoXForCausalLM'; supported: .*Qwen3"):
        LLM(model=odd)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(model=model_dir, dtype="float8")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=model_dir, max_model_len=10**6)
