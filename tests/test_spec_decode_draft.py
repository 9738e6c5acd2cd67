"""Draft-model speculative decoding on CPU (tiny fp32 models, async engine): greedy outputs equal those without
speculation at k = 1, 3, 5, also under a chunked-prefill budget and forced preemption.

Two drafts: the target itself (a perfect draft: for greedy requests EVERY draft must be accepted, which checks the
draft model's KV and drafting position by position) and an unrelated tiny Llama (drafts mostly rejected: checks
the rejection paths). Plus the refusals of a bad draft model.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 400) for _ in range(n)] for n in (1, 4, 9, 17, 30, 47)]


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root, "Qwen3ForCausalLM")
    other = make_tiny_model(root, "LlamaForCausalLM", seed=1)
    return target, other, _tokens(LLM(model=target, num_gpu_blocks_override=256))


def _spec(draft: Path, k: int) -> dict[str, object]:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


ENGINES: dict[str, dict[str, object]] = {
    "plain": {"num_gpu_blocks_override": 256},
    "chunked": {"num_gpu_blocks_override": 256, "max_num_batched_tokens": 11},
    "preempt": {"num_gpu_blocks_override": 11, "block_size": 8},
    # chunked, with the step kernels (the draft steps' advance among them) in Triton, as on CUDA (interpreted here)
    "triton": {"num_gpu_blocks_override": 256, "max_num_batched_tokens": 11, "use_triton": True},
}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_self_draft_accepts_everything_and_matches(models: tuple[Path, Path, list], k: int, engine: str) -> None:
    target, _, ref = models
    if engine == "triton" and k != 3:
        pytest.skip("one width is enough for the interpreted kernels")
    kwargs = ENGINES[engine]
    llm = LLM(model=target, speculative_config=_spec(target, k), **kwargs)
    assert _tokens(llm) == ref
    drafts, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert drafts > 0 and accepted == draft_tokens  # the target drafting for itself is never wrong
    if engine == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_unrelated_draft_matches(models: tuple[Path, Path, list], k: int) -> None:
    target, other, ref = models
    llm = LLM(model=target, num_gpu_blocks_override=256, max_num_batched_tokens=16, speculative_config=_spec(other, k))
    assert _tokens(llm) == ref
    drafts, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert drafts > 0 and accepted < draft_tokens


def test_bad_draft_models_are_refused(models: tuple[Path, Path, list], tmp_path: Path) -> None:
    target, _, _ = models
    small_vocab = make_tiny_model(tmp_path, "Qwen3ForCausalLM", vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=target, speculative_config=_spec(small_vocab, 2))
    with pytest.raises(ValueError, match="not a model directory"):
        LLM(model=target, speculative_config=_spec(tmp_path / "missing", 2))


def test_disable_by_batch_size_skips_drafting(models: tuple[Path, Path, list]) -> None:
    target, _, ref = models
    spec = {**_spec(target, 3), "disable_by_batch_size": 2}
    llm = LLM(model=target, num_gpu_blocks_override=256, speculative_config=spec)
    calls = 0
    propose = llm.engine.runner.proposer.propose

    def counted(*args: object, draft: bool = True) -> None:
        nonlocal calls
        calls += draft
        propose(*args, draft=draft)  # type: ignore[call-arg]

    llm.engine.runner.proposer.propose = counted  # type: ignore[method-assign]
    assert _tokens(llm) == ref
    assert llm.engine.stats.spec_decode_counts[0] == 0 and calls <= 1  # six requests: no drafting after admission
    one = llm.generate([{"prompt_token_ids": _prompts()[3]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert one == ref[3] and llm.engine.stats.spec_decode_counts[2] > 0 and calls > 1



def test_with_graphs_steps_outside_them_only_observe(models: tuple[Path, Path, list]) -> None:
    """With graphs, a step that misses its FULL graph (here: every step, through a dispatcher that plans them all
    piecewise) does not run the draft model's proposal round (its forwards would launch one by one), yet the
    draft model observes it; the tokens equal those without speculation. Without graphs (the other tests) the
    same engine drafts."""
    from contextlib import nullcontext

    from graphrunner.step_plan import StepMode, StepPlan

    class Piecewise:  # a GraphDispatcher with no FULL graph: every step runs "piecewise", here eagerly
        def plan(self, num_reqs: int, num_tokens: int, *args: object, **kwargs: object) -> StepPlan:
            return StepPlan(StepMode.PIECEWISE, num_reqs, num_tokens)

        def forward_mode(self, plan: StepPlan) -> nullcontext:
            return nullcontext()

    target, _, ref = models
    llm = LLM(model=target, num_gpu_blocks_override=256, speculative_config=_spec(target, 3))
    runner = llm.engine.runner
    runner.graphs = Piecewise()  # type: ignore[assignment]
    proposer = runner.proposer
    calls = {"draft": 0, "observe": 0}
    propose, observe = proposer.propose, proposer.observe

    def proposed(*args: object, draft: bool = True) -> None:
        calls["draft"] += draft
        propose(*args, draft=draft)  # type: ignore[call-arg]

    def observed(*args: object) -> object:
        calls["observe"] += 1
        return observe(*args)  # type: ignore[call-arg]

    proposer.propose = proposed  # type: ignore[method-assign]
    proposer.observe = observed  # type: ignore[method-assign]
    assert _tokens(llm) == ref
    assert calls["draft"] == 0 and calls["observe"] > 0
    assert llm.engine.stats.spec_decode_counts[2] == 0  # nothing proposed, nothing accepted
