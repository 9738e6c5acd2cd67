"""The capture manager's dispatch on CPU (no graphs needed): padding to captured sizes, the split-KV
variant for long contexts, fall-backs; and the FULL decode body run without a graph (padded rows
pointing at the padding row) gives the same tokens as the eager step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_model

from capture.manager import CaptureManager
from graphrunner import LLM, SamplingParams
from graphrunner.attention import triton_attention
from graphrunner.attention.triton_attention import choose_num_splits
from graphrunner.config import ModelConfig
from graphrunner.input_prep import StepBuffers
from graphrunner.step_plan import StepBodies, StepMode, StepPlan
from model_states.llama import LlamaModelState

_CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                   num_heads=8, num_kv_heads=8, head_dim=4)


def _manager(full: bool = True, pieces: list | None = None) -> CaptureManager:
    return CaptureManager(LlamaModelState(_CFG), StepBuffers(32, 64, 4, torch.device("cpu")),
                          [] if pieces is None else pieces, [1, 2, 4, 8, 16, 24, 32] if full else [],
                          [1, 2, 4, 8, 16, 32, 64], max_model_len=4096)


def test_plan_pads_uniform_decodes_to_full_sizes() -> None:
    m = _manager()
    assert m.plan(7, 7, 100, True) == StepPlan(StepMode.FULL, 8, 8, 1)
    assert m.plan(1, 1, 30, True) == StepPlan(StepMode.FULL, 1, 1, 1)
    assert m.plan(32, 32, 30, True) == StepPlan(StepMode.FULL, 32, 32, 1)
    long = m.plan(7, 7, 3000, True)
    assert long.mode is StepMode.FULL and long.num_splits == choose_num_splits(8, 8, 4096) > 1
    assert (8, 8, long.num_splits, False) in m.full_keys()


def test_plan_falls_back_to_piecewise_then_eager() -> None:
    m = _manager()
    assert m.plan(33, 33, 100, True) == StepPlan(StepMode.PIECEWISE, 33, 64)  # beyond the largest FULL size
    assert m.plan(5, 20, 100, False) == StepPlan(StepMode.PIECEWISE, 5, 32)   # not a plain decode: no padding rows
    assert m.plan(3, 65, 100, False) == StepPlan(StepMode.EAGER, 3, 65)       # beyond the largest bucket
    assert m.mode_counts[StepMode.PIECEWISE] == 2 and m.mode_counts[StepMode.EAGER] == 1
    assert _manager(full=False).plan(7, 7, 100, True) == StepPlan(StepMode.PIECEWISE, 7, 8)
    assert _manager(pieces=None).plan(5, 20, 100, False).mode is StepMode.PIECEWISE
    no_pieces = CaptureManager(LlamaModelState(_CFG), StepBuffers(2, 4, 4, torch.device("cpu")), None, [1, 2],
                               [1, 2, 4], max_model_len=4096)
    assert no_pieces.plan(2, 3, 10, False) == StepPlan(StepMode.EAGER, 2, 3)


def test_full_keys_are_largest_first() -> None:
    keys = _manager().full_keys()
    assert keys == sorted(keys, key=lambda k: (k[1], k[0], k[2]), reverse=True) and keys[0][0] == 32


class _GraphlessFull(CaptureManager):
    """Plans like the real manager, but 'replays' by running the FULL body eagerly (CPU has no graphs)."""

    bodies: StepBodies

    def replay_full(self, plan: StepPlan) -> Any:
        return self.bodies.full_step(plan.num_reqs, plan.num_tokens, plan.num_splits, plan.mixed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fullbody"), "Qwen3ForCausalLM")


def test_full_decode_body_with_padding_rows_matches_eager(model_dir: Path) -> None:
    prompts = [[3, 4, 5], [9] * 7, [11, 12], [100, 7, 8, 9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 40, "max_model_len": 64, "attention_backend": "triton",
                              "max_num_seqs": 8}
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model=model_dir, **kwargs)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len)
    manager.bodies = runner.capture_bodies()
    runner.graphs = manager
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert manager.mode_counts[StepMode.FULL] >= 5  # 4 requests padded to 8 rows
    assert got == expected
    state = runner.state
    assert int(state.num_tokens[state.padding_row]) == 1 and int(state.num_computed[state.padding_row]) == 0


def test_split_body_over_short_contexts_gives_eagers_tokens(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split-KV FULL decode body (max_model_len's splits, run without a graph) over contexts shorter than its
    splits cover, so that its last split programs find no key (they store nothing; the merge skips them), gives
    the eager engine's tokens, which split by the real context. The split thresholds are scaled down (16 keys a
    split, 32-key tiles) so that the interpreter's contexts stay short."""
    monkeypatch.setattr(triton_attention, "SPLIT_MIN_SEQ_LEN", 16)
    monkeypatch.setattr(triton_attention, "SPLIT_MIN_KEYS", 16)
    monkeypatch.setattr(triton_attention, "TILE_N", 32)
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 40, "max_model_len": 64, "attention_backend": "triton",
                              "max_num_seqs": 2}
    rng = torch.Generator().manual_seed(3)
    # decodes at 27-34 keys: 32-key slices, so 2-3 of the 4 splits are empty
    prompts = [torch.randint(0, 500, (27,), generator=rng).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model=model_dir, **kwargs)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2], [], runner.max_model_len)
    manager.bodies = runner.capture_bodies()
    runner.graphs = manager
    seen: list[int] = []
    replay = manager.replay_full
    monkeypatch.setattr(manager, "replay_full", lambda plan: (seen.append(plan.num_splits), replay(plan))[1])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert set(seen) == {4}, seen  # 2 KV heads, one split per 16 keys of max_model_len 64


def test_plan_mixed_full_for_small_batches_with_prefill() -> None:
    m = CaptureManager(LlamaModelState(_CFG), StepBuffers(32, 600, 4, torch.device("cpu")), [], [1, 2, 4, 8],
                       [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], max_model_len=4096,
                       mixed_sizes=[(1, 64), (1, 128), (4, 64), (4, 128)])
    one = m.plan(1, 50, 4000, False, True)  # a 50-token suffix over a long cached prefix
    assert one.mode is StepMode.FULL and one.mixed and (one.num_reqs, one.num_tokens) == (1, 64)
    assert one.num_splits == choose_num_splits(1 * 2, 8, 4096) > 1  # 2 query tiles of 32 tokens (GROUP 1)
    assert (1, 64, one.num_splits, True) in m.full_keys()
    assert m.plan(3, 100, 200, False, True) == StepPlan(StepMode.FULL, 4, 128, m.plan(4, 128, 1, False, True).num_splits,
                                                        mixed=True)
    assert m.plan(5, 100, 200, False, True).mode is StepMode.PIECEWISE   # more requests than any mixed graph
    assert m.plan(1, 129, 200, False, True).mode is StepMode.PIECEWISE   # more tokens than any mixed graph
    assert m.plan(1, 50, 200, False, False).mode is StepMode.PIECEWISE   # sampling a FULL graph does not cover
    assert m.plan(3, 3, 100, True, True) == StepPlan(StepMode.FULL, 4, 4, 1)  # a uniform decode keeps its graphs
    # a mixed step of <= MAX_M tokens stays in its small piecewise bucket, as eager it runs the small-M GEMV
    assert m.plan(2, 7, 200, False, True) == StepPlan(StepMode.PIECEWISE, 2, 8)
    assert m.plan(2, 9, 200, False, True).mixed


def test_plan_small_mixed_steps_take_the_graph_of_their_piecewise_bucket() -> None:
    """A step of <= 8 tokens (a prefix hit's short suffix beside a few decodes) replays a mixed FULL graph only of
    the token count its piecewise bucket pads it to: a larger one would move its linears across a GEMV limit."""
    sizes = LlamaModelState(_CFG).mixed_full_sizes(8, 512)
    assert [(p, t) for p, t in sizes if t <= 8] == [(1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8)]
    m = CaptureManager(LlamaModelState(_CFG), StepBuffers(32, 600, 4, torch.device("cpu")), [], [1, 2, 4, 8],
                       [1, 2, 4, 8, 16, 32, 64], max_model_len=4096, mixed_sizes=sizes)
    for reqs, tokens, graph in [(1, 2, (1, 2)), (1, 3, (1, 4)), (1, 5, (1, 8)), (2, 3, (2, 4)), (3, 7, (4, 8)),
                                (1, 8, (1, 8)), (4, 8, (4, 8))]:
        plan = m.plan(reqs, tokens, 200, False, True)
        assert plan.mode is StepMode.FULL and plan.mixed and (plan.num_reqs, plan.num_tokens) == graph, (reqs, tokens)
    # no mixed graph of 4 tokens for 3 rows, and 8 would pad past the bucket of 4: piecewise
    assert m.plan(3, 4, 200, False, True) == StepPlan(StepMode.PIECEWISE, 3, 4)
    assert m.plan(8, 8, 200, False, True).mode is StepMode.PIECEWISE  # 8 rows of one token: no room for a prefill
    assert m.plan(1, 9, 200, False, True).num_tokens == 64  # above MAX_M: the 64-token graph as before


def test_mixed_full_body_matches_eager(model_dir: Path) -> None:
    """Prefill chunks (new prompts, a chunked-prefill budget, cache hits) through the mixed FULL body, with
    padded rows and tokens, give the eager engine's tokens; decodes still use the decode graphs."""
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    prompts = [shared + [3, 4], [9] * 7, shared + [30], [100, 7, 8, 9, 10] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 60, "max_model_len": 64, "attention_backend": "triton",
                              "max_num_seqs": 8, "max_num_batched_tokens": 24, "block_size": 4}
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model=model_dir, **kwargs)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len,
                             mixed_sizes=[(1, 2), (1, 4), (2, 8), (2, 16), (4, 24)])
    manager.bodies = runner.capture_bodies()
    runner.graphs = manager
    first = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params)]  # fills the prefix cache
    outs = llm.generate(prompts, params)
    assert first == expected[:1] and [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].num_cached_tokens > 0 and outs[2].num_cached_tokens > 0
    assert manager.mixed_steps >= 3 and manager.mode_counts[StepMode.PIECEWISE] == 0
    # a hit that leaves 3 tokens: the 4-token mixed graph (no piecewise buckets here, so eager without it)
    short = shared + [40, 41]
    mixed, eager = manager.mixed_steps, manager.mode_counts[StepMode.EAGER]
    out = llm.generate([short], params)[0]
    assert out.num_cached_tokens == 16 and manager.mixed_steps == mixed + 1
    assert manager.mode_counts[StepMode.EAGER] == eager
    assert out.outputs[0].token_ids == LLM(model=model_dir, **kwargs).generate([short], params)[0].outputs[0].token_ids
