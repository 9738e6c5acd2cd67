"""Speculative decoding through the graph paths: the FULL verify body (uniform 1 + k steps) run without a graph on
CPU gives the same tokens as eager verify steps; on the GPU (marked gpu) the engine with CUDA graphs on, FULL
verify graphs replayed, gives the tokens of the engine without speculation, and its step loop never synchronises.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from sync_check import SyncFreeLaunches
from tiny_models import make_tiny_model

from capture.manager import CaptureManager
from graphrunner import LLM, SamplingParams
from graphrunner.step_plan import StepBodies, StepMode, StepPlan

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _prompts(vocab: int = 400) -> list[list[int]]:
    rng = random.Random(3)
    out = []
    for n in (2, 3, 4, 6, 9):
        pat = [rng.randrange(1, vocab) for _ in range(n)]
        out.append((pat * 6)[: 3 * n + 1])
    return out + [[rng.randrange(1, vocab) for _ in range(13)]]


class _GraphlessFull(CaptureManager):
    """Plans like the real manager, but 'replays' by running the FULL body eagerly (CPU has no graphs)."""

    bodies: StepBodies
    query_lens_replayed: list[int]

    def replay_full(self, plan: StepPlan) -> Any:
        if not plan.mixed:
            self.query_lens_replayed.append(plan.num_tokens // plan.num_reqs)
        return self.bodies.full_step(plan.num_reqs, plan.num_tokens, plan.num_splits, plan.mixed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("specgraphs"), "Qwen3ForCausalLM")


def test_full_verify_body_with_padding_rows_matches_eager(model_dir: Path) -> None:
    # the Triton attention (interpreted on CPU): a mixed graph's host shape is one query row of all its tokens,
    # which only the Triton kernel reads right (it takes each request's real length from the device)
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 60, "max_model_len": 96, "max_num_seqs": 8,
                              "speculative_config": SPEC, "attention_backend": "triton"}
    prompts = _prompts()
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.9, seed=5, max_tokens=32, ignore_eos=True)] * 2
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model=model_dir, **kwargs)
    runner = llm.engine.runner
    # mixed FULL graphs too: the admission step (six prompts) replays one, and the proposal runs inside it
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len,
                             [(8, 128), (8, 256)])
    manager.bodies = runner.capture_bodies()
    manager.query_lens_replayed = []
    runner.graphs = manager
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert manager.mixed_steps >= 1
    assert runner.model_state.full_query_lens == (1, 4)
    # six requests padded to 8 rows: verify steps of 4 tokens each (and plain decodes near max_tokens)
    assert manager.query_lens_replayed.count(4) >= 4
    assert got == expected
    assert llm.engine.stats.spec_decode_counts[2] > 0
    state = runner.state
    assert int(state.num_tokens[state.padding_row]) == 1 and int(state.num_computed[state.padding_row]) == 0


def test_full_verify_body_drafts_with_a_model(model_dir: Path) -> None:
    """The draft model inside the FULL bodies (observe the step's tokens and the next, draft k tokens): the target drafting for
    itself has every draft accepted, and the tokens equal eager ones."""
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 60, "max_model_len": 96, "max_num_seqs": 8,
                              "speculative_config": spec}
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, GREEDY)]
    llm = LLM(model=model_dir, **kwargs)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len)
    manager.bodies = runner.capture_bodies()
    manager.query_lens_replayed = []
    runner.graphs = manager
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert manager.query_lens_replayed.count(4) >= 4
    assert got == expected
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert draft_tokens > 0 and accepted == draft_tokens


def test_plain_decode_graphs_run_the_draft_model_only_below_disable_by_batch_size(model_dir: Path) -> None:
    """disable_by_batch_size 4, FULL graphs of 1, 2 and 8 rows, six requests of staggered lengths: no step with
    speculation off runs the draft model (the 8-row plain decode graph leaves it out); a step with speculation on
    always runs it, so a 3-row plain decode then skips the 8-row graph; the tokens equal eager ones without
    speculation, and a request admitted afterwards has every draft accepted (its draft KV is complete)."""
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 60, "max_model_len": 96, "max_num_seqs": 8}
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 8, 11, 14, 18)]
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model=model_dir, speculative_config=spec, **kwargs)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len)
    manager.bodies = runner.capture_bodies()
    manager.query_lens_replayed = []
    runner.graphs = manager
    steps: list[tuple[bool, int, StepMode]] = []  # (speculation on, requests, how the step ran)
    observed = {True: 0, False: 0}
    execute, plan, observe = runner.execute, manager.plan, runner.proposer.observe

    def step(sched: Any) -> Any:
        steps.append((sched.spec_active, len(sched.scheduled), StepMode.EAGER))
        return execute(sched)

    def planned(*args: Any, **kw: Any) -> StepPlan:
        out = plan(*args, **kw)
        steps[-1] = (*steps[-1][:2], out.mode)
        return out

    def counted(*args: Any) -> Any:
        observed[steps[-1][0]] += 1
        return observe(*args)

    runner.execute, manager.plan, runner.proposer.observe = step, planned, counted  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert observed[False] == 0 and observed[True] > 0
    assert any(not on and b > 3 and mode is StepMode.FULL for on, b, mode in steps)  # the 8-row graph, off
    assert any(on and b == 3 and mode is not StepMode.FULL for on, b, mode in steps)  # ... skipped when on
    assert llm.engine.stats.spec_decode_counts[0] == 0  # all six ran with speculation off once: no drafts
    again = llm.generate([prompts[3]], GREEDY)[0].outputs[0].token_ids
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert again == LLM(model=model_dir, **kwargs).generate([prompts[3]], GREEDY)[0].outputs[0].token_ids
    assert draft_tokens > 0 and accepted == draft_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_gpu_graphs_on_equal_without_speculation(tmp_path: Path, k: int) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    kwargs: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "device": "cuda", "max_num_seqs": 16}
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, GREEDY)]
    llm = LLM(model=model_dir, speculative_config={**SPEC, "num_speculative_tokens": k}, **kwargs)
    assert llm.engine.runner.graphs is not None  # graphs on
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    assert llm.engine.runner.graphs.mode_counts[StepMode.FULL] > 0  # FULL (verify) graphs replayed
    assert llm.engine.stats.spec_decode_counts[2] > 0
    # seeded sampling alone and in a batch, graphs on
    params = [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=32, ignore_eos=True) for i in range(len(prompts))]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


@pytest.mark.gpu
def test_gpu_draft_model_graphs_on_equal_without_speculation(tmp_path: Path) -> None:
    """FULL verify graphs hold the draft model's forwards; the target drafting for itself accepts (almost) all."""
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    kwargs: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "device": "cuda", "max_num_seqs": 16}
    prompts = _prompts()
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, GREEDY)]
    spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    llm = LLM(model=model_dir, speculative_config=spec, **kwargs)
    assert llm.engine.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.runner.graphs.mode_counts[StepMode.FULL] > 0  # FULL verify graphs, the draft inside
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert accepted > 0.9 * draft_tokens  # bf16-free fp32: the self-draft agrees (almost) everywhere


@pytest.mark.gpu
def test_gpu_spec_step_loop_never_synchronises(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(model=model_dir, max_model_len=256, num_gpu_blocks_override=24, max_num_batched_tokens=32,
              block_size=16, device="cuda", speculative_config=SPEC)
    engine = llm.engine
    launches = SyncFreeLaunches(engine)
    extras = [{}, {"top_k": 5, "top_p": 0.9}, {"logprobs": 2}, {"repetition_penalty": 1.2}, {"min_tokens": 4}]
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=i, **extras[i % len(extras)])
              for i, t in enumerate([0.0, 0.7, 1.0] * 4)]
    outs = llm.generate((_prompts() * 2)[:12], params)
    assert launches.count > 10 and all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert engine.stats.spec_decode_counts[2] > 0
