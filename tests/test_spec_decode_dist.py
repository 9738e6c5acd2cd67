"""Sampled speculative decoding keeps the target distribution: a chi-square two-sample test on a tiny-vocabulary
model compares the tokens of many seeded sampled requests with and without n-gram speculation (per output position),
and the same test rejects a deliberately broken acceptance rule (every draft accepted).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency
from tiny_models import make_tiny_model

import graphrunner.spec_decode.sampler as spec_sampler
from graphrunner import LLM, SamplingParams

VOCAB = 24
NUM_REQUESTS = 320
NEW_TOKENS = 6
TEMPERATURE = 0.3
PROMPT = [3, 5, 7, 3, 5, 7, 3, 5, 7, 3, 5]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec_dist"), "Qwen3ForCausalLM", vocab_size=VOCAB)


def _histogram(model_dir: Path, seed_base: int, spec: dict | None) -> tuple[Counter, LLM]:
    llm = LLM(model=model_dir, skip_tokenizer_init=True, num_gpu_blocks_override=512, max_model_len=64,
              max_num_seqs=NUM_REQUESTS, speculative_config=spec)
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, ignore_eos=True, seed=seed_base + i,
                             detokenize=False) for i in range(NUM_REQUESTS)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_REQUESTS, params, use_tqdm=False)
    counts: Counter = Counter()
    for o in outs:
        toks = o.outputs[0].token_ids
        assert len(toks) == NEW_TOKENS
        counts.update((pos, t) for pos, t in enumerate(toks) if pos > 0)  # position 0 is never speculated
    return counts, llm


def _p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square over (position, token) cells; cells with fewer than 10 samples in all are pooled."""
    cells = sorted(set(a) | set(b))
    big = [c for c in cells if a[c] + b[c] >= 10]
    rest = [c for c in cells if a[c] + b[c] < 10]
    table = [[a[c] for c in big] + [sum(a[c] for c in rest)], [b[c] for c in big] + [sum(b[c] for c in rest)]]
    if not rest:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table).pvalue)


def test_sampled_distribution_matches_without_speculation(model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    plain, _ = _histogram(model_dir, 0, None)
    spec, llm = _histogram(model_dir, 10_000, SPEC)  # other seeds: two independent samples
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert draft_tokens > NUM_REQUESTS and accepted > NUM_REQUESTS // 4  # drafts were verified and accepted
    assert _p_value(plain, spec) > 1e-3

    real = spec_sampler.rejection_sample

    def accept_everything(logits, cu, draft_ids, num_drafts, draft_probs, temperature, seeds, positions, use_triton):
        # q(d) = 0 makes the ratio test accept every draft: the output then follows the proposer, not the model
        q = torch.zeros(logits.shape[0] - draft_ids.shape[0], logits.shape[1], device=logits.device)
        return real(logits, cu, draft_ids, num_drafts, q, temperature, seeds, positions, use_triton)

    monkeypatch.setattr(spec_sampler, "rejection_sample", accept_everything)
    broken, _ = _histogram(model_dir, 10_000, SPEC)
    assert _p_value(plain, broken) < 1e-6
