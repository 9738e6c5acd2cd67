"""n-gram speculative decoding end to end on CPU (tiny fp32 models, async engine): greedy outputs with speculation
equal those without at k = 1, 3, 5, under a chunked-prefill budget and forced preemption; stops, max_tokens and
max_model_len inside an accepted run; logprobs per accepted token; seeded sampling batch-independent; metrics.

Prompts repeat a random pattern, so prompt lookup proposes and a random model's greedy loops get accepted; each
test asserts that drafts were accepted (equal outputs with nothing accepted would prove little).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams

NEW_TOKENS = 40
ARCHS = ["Qwen3ForCausalLM", "LlamaForCausalLM"]


def _prompts(seed: int = 0) -> list[list[int]]:
    """Repeated random patterns of several lengths, plus one prompt with no repetition."""
    rng = random.Random(seed)
    out = []
    for n in (2, 3, 5, 8, 11):
        pat = [rng.randrange(1, 400) for _ in range(n)]
        out.append((pat * 8)[: 4 * n + rng.randrange(n)])
    out.append([rng.randrange(1, 400) for _ in range(23)])
    return out


def _spec(k: int, **extra: object) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **extra}


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _accepted(llm: LLM) -> int:
    return llm.engine.stats.spec_decode_counts[2]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def model_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("spec"), request.param)
    ref = _tokens(_generate(LLM(model=model_dir, num_gpu_blocks_override=256), _prompts(), GREEDY))
    return model_dir, ref


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equal_without_speculation(model_case: tuple[Path, list], k: int) -> None:
    model_dir, ref = model_case
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(k))
    assert _tokens(_generate(llm, _prompts(), GREEDY)) == ref
    drafts, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert drafts > 0 and 0 < accepted <= draft_tokens
    assert llm.engine.stats.mean_acceptance_length > 1.0


def test_greedy_equal_with_the_triton_kernels(model_case: tuple[Path, list]) -> None:
    """use_triton=True (as on CUDA; the interpreter here): the n-gram kernel, the split rejection kernels and the
    draft read / write and post-verify update kernels, under a chunked-prefill budget so eager verify steps of
    several widths meet them. Three prompts: every kernel runs interpreted."""
    model_dir, ref = model_case
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, max_num_batched_tokens=13, speculative_config=_spec(4),
              use_triton=True, attention_backend="triton")
    assert _tokens(_generate(llm, _prompts()[:3], GREEDY)) == ref[:3]
    assert _accepted(llm) > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equal_under_chunked_prefill(model_case: tuple[Path, list], k: int) -> None:
    model_dir, ref = model_case
    # 13 tokens a step: prompts are chunked, and verify steps compete for the budget (their drafts get cut)
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, max_num_batched_tokens=13, speculative_config=_spec(k))
    assert _tokens(_generate(llm, _prompts(), GREEDY)) == ref
    assert _accepted(llm) > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equal_under_preemption(model_case: tuple[Path, list], k: int) -> None:
    model_dir, ref = model_case
    # 15 usable blocks of 8 slots hold the longest request (prompt <= 54 + 40 tokens) but never all of them
    llm = LLM(model=model_dir, num_gpu_blocks_override=16, block_size=8, speculative_config=_spec(k))
    assert _tokens(_generate(llm, _prompts(), GREEDY)) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert _accepted(llm) > 0


def test_stops_inside_accepted_runs(model_case: tuple[Path, list]) -> None:
    """Stop ids, max_tokens and max_model_len end each request at the same token as without speculation; the
    run's later tokens are dropped."""
    model_dir, ref = model_case
    prompts = _prompts()
    params = []
    for i, toks in enumerate(ref):
        # late stops: a random model's greedy output settles into loops that the drafts then predict
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[toks[24 + i]]))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=21 + 2 * i, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                         stop_token_ids=[toks[30]], include_stop_str_in_output=True))
    base = _generate(LLM(model=model_dir, num_gpu_blocks_override=256), prompts, params)
    for k in (3, 5):
        llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(k))
        outs = _generate(llm, prompts, params)
        for o, b in zip(outs, base):
            assert o.outputs[0].token_ids == b.outputs[0].token_ids
            assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == (b.outputs[0].finish_reason,
                                                                             b.outputs[0].stop_reason)
        assert _accepted(llm) > 0
    assert any(b.outputs[0].finish_reason == "stop" for b in base)


def test_max_model_len_inside_accepted_runs(model_case: tuple[Path, list]) -> None:
    model_dir, _ = model_case
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    base = _tokens(_generate(LLM(model=model_dir, num_gpu_blocks_override=256, max_model_len=64), prompts, params))
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, max_model_len=64, speculative_config=_spec(5))
    outs = _generate(llm, prompts, params)
    assert _tokens(outs) == base
    assert all(len(p) + len(t) == 64 for p, t in zip(prompts, base))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert _accepted(llm) > 0


def test_stop_string_inside_an_accepted_run(model_case: tuple[Path, list]) -> None:
    """A stop string found in the middle of a run: the text ends before it and the run's later tokens are gone."""
    model_dir, _ = model_case
    base_llm = LLM(model=model_dir, num_gpu_blocks_override=256)
    prompts = _prompts()
    plain = _generate(base_llm, prompts, GREEDY)
    params = []
    for o in plain:
        text = o.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2].strip() or text[-2:]
        params.append(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop]))
    base = _generate(base_llm, prompts, params)
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(5))
    outs = _generate(llm, prompts, params)
    for o, b in zip(outs, base):
        assert (o.outputs[0].text, o.outputs[0].token_ids) == (b.outputs[0].text, b.outputs[0].token_ids)
        assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == (b.outputs[0].finish_reason,
                                                                         b.outputs[0].stop_reason)
    assert sum(b.outputs[0].finish_reason == "stop" for b in base) >= 3
    assert _accepted(llm) > 0


def test_logprobs_per_accepted_token(model_case: tuple[Path, list]) -> None:
    model_dir, _ = model_case
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    base = _generate(LLM(model=model_dir, num_gpu_blocks_override=256), _prompts(), params)
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(3))
    outs = _generate(llm, _prompts(), params)
    assert _accepted(llm) > 0
    for o, b in zip(outs, base):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(o.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for mine, theirs in zip(o.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(mine) == list(theirs)
            for tok in mine:
                assert mine[tok].rank == theirs[tok].rank
                assert mine[tok].logprob == pytest.approx(theirs[tok].logprob, abs=1e-4)
        assert o.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)


def test_seeded_sampling_is_batch_independent(model_case: tuple[Path, list]) -> None:
    model_dir, _ = model_case
    prompts = _prompts()
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(3))
    # a low temperature (the tiny random model's logits are flat) so that sampled drafts get accepted
    params = [SamplingParams(temperature=0.1 if i % 2 else 0.3, top_k=20, top_p=0.95, max_tokens=NEW_TOKENS,
                             ignore_eos=True, seed=100 + i) for i in range(len(prompts))]
    together = _tokens(_generate(llm, prompts, params))
    alone = [_tokens(_generate(llm, [p], sp))[0] for p, sp in zip(prompts, params)]
    assert together == alone
    assert _accepted(llm) > 0


def test_requests_that_cannot_speculate_decode_exactly(model_case: tuple[Path, list]) -> None:
    """Penalties, logit bias and min_tokens keep a request off the verify path; mixed with speculating
    requests in one step, each still gets exactly its non-speculative tokens."""
    model_dir, _ = model_case
    prompts = _prompts()
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3),
              GREEDY, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias={7: 3.0}),
              SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=12), GREEDY]
    base = _tokens(_generate(LLM(model=model_dir, num_gpu_blocks_override=256), prompts, params))
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(3))
    assert _tokens(_generate(llm, prompts, params)) == base
    assert _accepted(llm) > 0


def test_disable_by_batch_size(model_case: tuple[Path, list]) -> None:
    model_dir, ref = model_case
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(3, disable_by_batch_size=2))
    assert _tokens(_generate(llm, _prompts(), GREEDY)) == ref
    assert llm.engine.stats.spec_decode_counts[0] == 0  # six requests: never speculated
    alone = _tokens(_generate(llm, _prompts()[:1], GREEDY))
    assert alone == ref[:1] and _accepted(llm) > 0  # one request: it does


def test_metrics_expose_spec_counters(model_case: tuple[Path, list]) -> None:
    model_dir, _ = model_case
    llm = LLM(model=model_dir, num_gpu_blocks_override=256, speculative_config=_spec(3))
    _generate(llm, _prompts(), GREEDY)
    drafts, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    text = llm.engine.stats.to_prometheus_text()
    assert "vllm:spec_decode_num_draft_tokens_total{" in text
    lines = {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
             if ln.startswith("vllm:spec_decode_num_") and "per_pos" not in ln}
    assert lines["vllm:spec_decode_num_draft_tokens_total"] == draft_tokens
    assert lines["vllm:spec_decode_num_accepted_tokens_total"] == accepted
    assert lines["vllm:spec_decode_num_drafts_total"] == drafts
    per_pos = {m.name: m for m in llm.get_metrics()}["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos.values) == accepted and len(per_pos.values) == 3
    assert llm.engine.stats.spec_accepted_per_pos == tuple(per_pos.values)
    assert per_pos.values == sorted(per_pos.values, reverse=True)  # accepted runs are prefixes
