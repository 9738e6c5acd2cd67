"""Tensor parallelism on CPU (gloo, two ranks: this process and one spawned worker) against one rank.

Tiny fp32 Qwen3 (tied embeddings, a vocabulary that does not split evenly), Llama (one KV head, replicated on
both ranks) and Qwen2 (two KV heads, split; q/k/v biases): greedy tokens, seeded sampled tokens (with filters:
gathered logits; plain: per-shard Gumbel-max) and logprobs of TP=2 equal TP=1's, with chunked prefill and
preemption forced. Also the sharding arithmetic, the loader's
per-rank shards (rank models built in this process, summed by hand) and the step plan's wire format.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model, model_state_for

import graphrunner.parallel_state as ps
from graphrunner import LLM, SamplingParams
from graphrunner.loader import load_model
from graphrunner.request import Request
from graphrunner.scheduler import ScheduledRequest, SchedulerOutput
from graphrunner.tp_plan import RowMirror, encode_plan

NEW_TOKENS = 24
PROMPT_LENS = [1, 5, 17, 31, 50, 70]
CASES = {
    "qwen3-odd-vocab": ("Qwen3ForCausalLM", {"vocab_size": 509}),  # 255 rows per rank, one of them padding
    "llama-1-kv-head": ("LlamaForCausalLM", {"num_key_value_heads": 1}),  # replicated on both ranks
    "qwen2": ("Qwen2ForCausalLM", {}),  # 2 KV heads: one per rank
}
# chunked prefill (13 tokens a step) and preemption (12 blocks of 16 never hold every request) in every run
ENGINE = {"max_model_len": 256, "num_gpu_blocks_override": 12, "block_size": 16, "max_num_batched_tokens": 13}


def _prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(400) for _ in range(n)]} for n in PROMPT_LENS]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


def _sampled() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=NEW_TOKENS, ignore_eos=True,
                           seed=100 + i) for i in range(len(PROMPT_LENS))]


def _plain() -> list[SamplingParams]:
    """Greedy and temperature-only sampling without logprobs: each rank samples its vocabulary shard."""
    return [SamplingParams(temperature=[0.0, 0.8][i % 2], max_tokens=NEW_TOKENS, ignore_eos=True, seed=200 + i)
            for i in range(len(PROMPT_LENS))]


def _run(llm: LLM) -> dict[str, Any]:
    greedy = llm.generate(_prompts(), _greedy(), use_tqdm=False)
    sampled = llm.generate(_prompts(), _sampled(), use_tqdm=False)
    plain = llm.generate(_prompts(), _plain(), use_tqdm=False)
    several = llm.generate(_prompts()[3:5], SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True,
                                                           prompt_logprobs=1), use_tqdm=False)
    return {
        "several": [[list(c.token_ids) for c in o.outputs] for o in several],
        "prompt_logprobs": [[None if p is None else {t: round(lp.logprob, 4) for t, lp in p.items()}
                             for p in o.prompt_logprobs] for o in several],
        "greedy": [list(o.outputs[0].token_ids) for o in greedy],
        "logprobs": [o.outputs[0].logprobs for o in greedy],
        "sampled": [list(o.outputs[0].token_ids) for o in sampled],
        "plain": [list(o.outputs[0].token_ids) for o in plain],
        "preemptions": llm.engine.scheduler.num_preemptions,
    }


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, dict]]:
    arch, overrides = CASES[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    one = _run(LLM(model=model_dir, **ENGINE))
    llm = LLM(model=model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        yield one, _run(llm)
    finally:
        llm.engine.shutdown()


def test_greedy_tokens_equal_one_rank(case: tuple[dict, dict]) -> None:
    one, two = case
    assert two["greedy"] == one["greedy"]
    assert one["preemptions"] > 0 and two["preemptions"] > 0  # the runs went through preemption


def test_seeded_sampling_equals_one_rank(case: tuple[dict, dict]) -> None:
    one, two = case
    assert two["sampled"] == one["sampled"]
    assert len({tuple(t) for t in one["sampled"]} - {tuple(t) for t in one["greedy"]}) > 0  # it did sample


def test_plain_batches_sampled_per_shard_equal_one_rank(case: tuple[dict, dict]) -> None:
    one, two = case
    assert two["plain"] == one["plain"]
    assert one["plain"][0] == one["greedy"][0] and one["plain"][1] != one["greedy"][1]  # greedy, and sampled


def test_n_completions_and_prompt_logprobs_equal_one_rank(case: tuple[dict, dict]) -> None:
    one, two = case
    assert two["several"] == one["several"] and all(a != b for a, b in one["several"])
    for lp_one, lp_two in zip(one["prompt_logprobs"], two["prompt_logprobs"], strict=True):
        assert len(lp_one) == len(lp_two) > 30
        for a, b in zip(lp_one, lp_two, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)


def test_logprobs_equal_one_rank(case: tuple[dict, dict]) -> None:
    one, two = case
    for lp_one, lp_two in zip(one["logprobs"], two["logprobs"], strict=True):
        for a, b in zip(lp_one, lp_two, strict=True):
            assert a.keys() == b.keys()
            for tok in a:
                assert b[tok].logprob == pytest.approx(a[tok].logprob, abs=1e-4)
                assert b[tok].rank == a[tok].rank


# ---- sharding arithmetic and per-rank weights (no processes) -------------------------------------

@pytest.mark.parametrize(("num_heads", "num_kv_heads", "world"),
                         [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (12, 4, 2), (16, 2, 8), (6, 3, 3)])
def test_each_rank_holds_the_kv_heads_of_its_query_heads(num_heads: int, num_kv_heads: int, world: int) -> None:
    group = num_heads // num_kv_heads
    for rank in range(world):
        q_start, q_count = ps.shard_range(num_heads, rank, world)
        kv_start, kv_count = ps.kv_head_range(num_kv_heads, rank, world)
        needed = {h // group for h in range(q_start, q_start + q_count)}
        assert needed == set(range(kv_start, kv_start + kv_count))


def test_impossible_splits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not split evenly"):
        ps.shard_range(6, 0, 4)
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads=3"):
        ps.kv_head_range(3, 0, 4)
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", num_key_value_heads=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit the model"):
        LLM(model=model_dir, tensor_parallel_size=3)


@pytest.fixture
def rank_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The Qwen3 (odd vocabulary) loaded whole, and as each of 2 ranks would load it (built here, no group)."""
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM", vocab_size=509)
    models = []
    for state in (ps.TPState(), ps.TPState(0, 2), ps.TPState(1, 2)):  # (restored afterwards by monkeypatch)
        monkeypatch.setattr(ps, "_STATE", state)
        models.append(load_model(model_dir, model_state_for(model_dir), torch.float32, "cpu"))
    return models[0], models[1:]


def test_rank_shards_sum_to_the_whole_model(rank_models: tuple[torch.nn.Module, list[torch.nn.Module]]) -> None:
    full, ranks = rank_models
    torch.manual_seed(0)
    x = torch.randn(5, full.config.hidden_size)
    # MLP: each rank's column-parallel gate-up and row-parallel down give a partial sum of the whole
    mlps = [r.model.layers[1].mlp for r in ranks]
    partial = sum(F.linear(F.silu(g) * u, m.down_proj.weight)
                  for m in mlps for g, u in [m.gate_up_proj(x).chunk(2, dim=-1)])
    torch.testing.assert_close(partial, full.model.layers[1].mlp(x), rtol=1e-5, atol=1e-5)
    # attention projections: the ranks' q/k/v rows are the whole model's, head by head
    attn = [r.model.layers[0].self_attn for r in ranks]
    q, k, v = full.model.layers[0].self_attn.qkv_proj(x).split([64, 32, 32], dim=-1)
    parts = [a.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1) for a in attn]
    for i, whole in enumerate((q, k, v)):
        torch.testing.assert_close(torch.cat([p[i] for p in parts], dim=-1), whole)
    # embedding: each id is found on exactly one rank; the LM head's rows (tied) are the vocabulary plus padding
    ids = torch.tensor([0, 1, 253, 254, 255, 256, 508])
    emb = [r.model.embed_tokens for r in ranks]
    looked_up = sum(F.embedding(torch.where((ids >= e.vocab_start) & (ids < e.vocab_start + 255),
                                            ids - e.vocab_start, 0), e.weight)
                    * ((ids >= e.vocab_start) & (ids < e.vocab_start + 255)).unsqueeze(-1) for e in emb)
    torch.testing.assert_close(looked_up, full.model.embed_tokens(ids))
    rows = torch.cat([e.weight for e in emb])  # [510, H]
    torch.testing.assert_close(rows[:509], full.model.embed_tokens.weight)
    assert rows[509].abs().sum() == 0


# ---- the step plan on the wire ---------------------------------------------------------------------

def _request(rid: str, prompt: list[int], outputs: list[int], inflight: int) -> Request:
    req = Request(rid, rid, 0, prompt, SamplingParams(temperature=0.5, seed=7), 7, 32,
                  output_token_ids=list(outputs), num_inflight=inflight, block_ids=[3, 4], row=2)
    return req


def test_plan_round_trip_rebuilds_the_runner_view() -> None:
    req = _request("a", [5, 6, 7], [8], 1)
    first = SchedulerOutput([ScheduledRequest(req, 2, 2, True, [3, 4], 0, 5, True, 0)])
    mirror = RowMirror()
    got = mirror.decode(encode_plan(first))
    assert got is not None
    s = got.scheduled[0]
    assert (s.row, s.num_tokens, s.is_new, s.new_block_ids, s.seq_len, s.samples) == (2, 2, True, [3, 4], 5, True)
    assert s.request.all_token_ids() == [5, 6, 7, 8] and s.request.num_generated == 2
    assert s.request.params.seed == 7 and s.request.block_ids == []  # host bookkeeping stays on rank 0
    req.output_token_ids += [9, 10]  # two more tokens later: the plan names the row and the new count
    req.num_inflight = 1
    later = mirror.decode(encode_plan(SchedulerOutput([ScheduledRequest(req, 2, 1, False, [], 2, 6, True, 0)])))
    assert later is not None and later.scheduled[0].request.num_generated == req.num_generated == 4
    # several requests, new and old, each with its own new blocks
    other = _request("b", [1], [], 0)
    mixed = SchedulerOutput([ScheduledRequest(req, 2, 1, False, [9], 2, 7, True, 0),
                             ScheduledRequest(other, 4, 1, True, [11, 12, 13], 0, 1, False, 0),
                             ScheduledRequest(req, 2, 0, False, [], 3, 7, False, 0)])
    got = mirror.decode(encode_plan(mixed))
    assert got is not None
    assert [(s.row, s.is_new, s.new_block_ids, s.first_new_block, s.samples, s.request.request_id)
            for s in got.scheduled] == [(2, False, [9], 2, True, "a"), (4, True, [11, 12, 13], 0, False, "b"),
                                        (2, False, [], 3, False, "a")]
    with pytest.raises(RuntimeError, match="row 5, which was never admitted"):
        RowMirror().decode(encode_plan(SchedulerOutput([ScheduledRequest(req, 5, 1, False, [], 0, 6, True, 0)])))
