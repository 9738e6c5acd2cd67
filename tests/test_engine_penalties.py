"""Penalties from the persistent statistics, end to end on a tiny model: at every step the engine's penalised logits
equal the recounting reference's (apply_penalties_history_ref over the row's history, bit for bit) and every
penalised row's statistics equal a fresh count of its history; tokens equal a calm engine's, through preemption,
chunked prefill, n > 1, prefix-cache hits and n-gram speculative decoding (the engine is always async).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_greedy, make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.penalty_counts import PenaltyCounts, fill_counts_ref
from graphrunner.sampling import sampler as sampler_module
from graphrunner.sampling.penalties import apply_penalties_history_ref
from graphrunner.spec_decode import sampler as spec_sampler_module

NEW = 24
BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("penalties"), "Qwen3ForCausalLM")


class _Oracle:
    """Wraps the sampler's apply_penalties: before it runs, compare the statistics of every penalised row in the
    batch with a recount of the row's history; after, compare the logits with the recounting reference's."""

    def __init__(self, llm: LLM, real: Any) -> None:
        self.state = llm.engine.runner.state
        self.real = real
        self.rows_checked = 0
        self.batches = 0

    def __call__(self, logits: torch.Tensor, idx: torch.Tensor, pen: PenaltyCounts, use_triton: bool) -> None:
        st = self.state
        expected = logits.clone()
        apply_penalties_history_ref(expected, idx, st.token_ids, st.prompt_len, st.num_tokens, st.repetition_penalty,
                                    st.presence_penalty, st.frequency_penalty)
        rows = sorted({r for r in idx.tolist() if (float(pen.repetition[r]) != 1.0 or float(pen.presence[r]) != 0.0
                                                   or float(pen.frequency[r]) != 0.0)})
        if rows:
            fresh = PenaltyCounts.allocate(pen.output_counts.shape[0], pen.vocab_size, pen.repetition, pen.presence,
                                           pen.frequency)
            r = torch.tensor(rows, dtype=torch.int32)
            fill_counts_ref(r, st.token_ids, st.prompt_len, st.num_tokens, fresh.output_counts, fresh.prompt_mask)
            assert torch.equal(pen.output_counts[r.long()], fresh.output_counts[r.long()]), rows
            assert torch.equal(pen.prompt_mask[r.long()], fresh.prompt_mask[r.long()]), rows
        self.real(logits, idx, pen, use_triton)
        assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))
        self.rows_checked += len(rows)
        self.batches += 1


def _watch(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> _Oracle:
    oracle = _Oracle(llm, sampler_module.apply_penalties)
    monkeypatch.setattr(sampler_module, "apply_penalties", oracle)
    monkeypatch.setattr(spec_sampler_module, "apply_penalties", oracle)
    return oracle


def _prompts() -> list[list[int]]:
    """Repetitive prompts (penalties bite), two sharing a 2-block prefix with a third (prefix-cache hits)."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 300) for _ in range(2 * BS)]
    out = [(p * 12)[:n] for p, n in (([5, 9, 5, 17], 30), ([40, 41, 42], 45), ([7], 9), ([100, 3, 100], 70))]
    out += [shared + [11, 12, 13], shared + [14] * 20, shared]
    return out


def _params() -> list[SamplingParams]:
    kw: dict[str, Any] = {"max_tokens": NEW, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, **kw),
        SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4, **kw),
        SamplingParams(temperature=0.0, **kw),  # neutral, in the same batches
        SamplingParams(temperature=0.9, seed=5, repetition_penalty=0.8, presence_penalty=-0.3, frequency_penalty=0.9,
                       **kw),
        SamplingParams(temperature=0.8, seed=6, n=2, frequency_penalty=1.5, **kw),
        SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.2, **kw),
        SamplingParams(temperature=1.0, seed=7, presence_penalty=1.0, **kw),
    ]


def _tokens(outs: list) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _generate(llm: LLM) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params())


@pytest.fixture(scope="module")
def calm(model_dir: Path) -> list[list[list[int]]]:
    """Tokens of an engine with room for everything: no preemption, no chunking, no prefix caching."""
    return _tokens(_generate(LLM(model=model_dir, num_gpu_blocks_override=512, enable_prefix_caching=False)))


def test_calm_engine_matches_the_recount_and_hf(model_dir: Path, calm: list, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(model=model_dir, num_gpu_blocks_override=512, enable_prefix_caching=False)
    oracle = _watch(llm, monkeypatch)
    assert _tokens(_generate(llm)) == calm
    assert oracle.rows_checked >= 7 * NEW  # every penalised request (n = 2: two rows), every step
    # greedy repetition penalty == HF's RepetitionPenaltyLogitsProcessor on the same model
    prompt = _prompts()[0]
    hf = _hf_greedy_with(model_dir, prompt, NEW, repetition_penalty=1.3)
    assert calm[0][0] == hf
    assert calm[0][0] != hf_greedy(model_dir, prompt, NEW)  # the penalty changed the output


def _hf_greedy_with(model_dir: Path, prompt: list[int], n: int, **kw: float) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


def test_preemption_chunked_prefill_prefix_hits_and_n2(model_dir: Path, calm: list,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Small cache (preemption: resumed rows recount their outputs at admission), a 24-token budget (prompts of
    up to 70 tokens arrive in chunks), prefix caching on (shared prompts hit), n = 2 children."""
    llm = LLM(model=model_dir, num_gpu_blocks_override=14, block_size=BS, max_num_batched_tokens=24,
              enable_prefix_caching=True)
    oracle = _watch(llm, monkeypatch)
    outs = _generate(llm)
    assert _tokens(outs) == calm
    assert llm.engine.scheduler.num_preemptions > 0
    assert max(len(p) for p in _prompts()) > 24  # chunked
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert oracle.rows_checked >= 7 * NEW


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_speculation_beside_penalised_requests(model_dir: Path, calm: list, k: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Penalised requests never get drafts, but share verify steps with requests that do: the verify update counts
    their one token a step (post_update_spec's hook)."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model=model_dir, num_gpu_blocks_override=512, speculative_config=spec, max_num_batched_tokens=40)
    oracle = _watch(llm, monkeypatch)
    verify_calls = []
    real_verify = spec_sampler_module.apply_penalties

    def verify_apply(*args: Any) -> None:
        verify_calls.append(1)
        real_verify(*args)

    monkeypatch.setattr(spec_sampler_module, "apply_penalties", verify_apply)
    assert _tokens(_generate(llm)) == calm
    assert llm.engine.stats.spec_decode_counts[2] > 0  # drafts were accepted (the neutral greedy request)
    assert verify_calls  # penalties ran inside verify steps
    assert oracle.rows_checked >= 7 * NEW


def test_stats_of_a_reused_row_are_rebuilt(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are reused across requests: a new owner with penalties never sees the previous owner's counts."""
    llm = LLM(model=model_dir, num_gpu_blocks_override=512, max_num_seqs=2)
    oracle = _watch(llm, monkeypatch)
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.2)
    prompts = _prompts()[:5]
    many = _tokens(llm.generate([{"prompt_token_ids": q} for q in prompts], p))
    alone = [_tokens(llm.generate([{"prompt_token_ids": q}], p))[0] for q in prompts]
    assert many == alone
    assert oracle.rows_checked > 0
