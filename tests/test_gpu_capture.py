"""CUDA graphs on the GPU (`-m gpu`): eager, PIECEWISE and FULL execution, FULL graphs of the uncompiled model
(compilation level 0) and the default graphs of eager pieces (compilation_config backend "eager") give identical greedy tokens for awkward batch sizes (padded up to captured sizes), for mixed
prefill/decode steps and for seeded and filtered sampling; padded rows of a FULL replay write no KV; the step loop
with graphs never synchronises with the host.

The model is a tiny fp32 Qwen3, so the three modes differ only in how the same math is launched.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sync_check import SyncFreeLaunches
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.step_plan import StepMode

pytestmark = pytest.mark.gpu

BATCH_SIZES = [1, 7, 16, 25, 33, 45, 64, 123]
NEW_TOKENS = 10
INDUCTOR = {"backend": "inductor"}  # (the default is eager pieces: these two keep Inductor's pieces under test)
MODES = {"eager": {"enforce_eager": True}, "piecewise": {"cudagraph_mode": "piecewise", "compilation_config": INDUCTOR},
         "full": {"compilation_config": INDUCTOR},
         "uncompiled": {"compilation_config": {"level": 0, "cudagraph_mode": "FULL"}},
         "eager_pieces": {"compilation_config": {"backend": "eager"}}}  # FULL + piecewise graphs, no Inductor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("capture"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> dict[str, LLM]:
    return {name: LLM(model=model_dir, dtype="float32", max_model_len=256, device="cuda", **kw)
            for name, kw in MODES.items()}


def _prompts(n: int, seed: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _counts(llm: LLM) -> dict[StepMode, int]:
    graphs = llm.engine.runner.graphs
    return dict(graphs.mode_counts) if graphs is not None else {}


def _staggered(llm: LLM) -> dict[str, list[int]]:
    """Requests arriving while others decode: steps that mix prefill chunks with decodes."""
    engine = llm.engine
    done: dict[str, list[int]] = {}
    waves = [_prompts(6, 100), _prompts(9, 101, 20, 90), _prompts(4, 102, 1, 5)]
    for wave, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            engine.add_request({"prompt_token_ids": p}, _greedy(14), request_id=f"{wave}-{i}")
        for _ in range(3):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_modes_dispatch_as_configured(engines: dict[str, LLM]) -> None:
    assert engines["eager"].engine.runner.graphs is None
    for name in ("piecewise", "full", "eager_pieces"):
        manager = engines[name].engine.runner.graphs
        assert manager is not None and manager.num_graphs > 0 and manager.pool_bytes > 0, name
    assert not engines["piecewise"].engine.runner.graphs.full_keys()
    uncompiled = engines["uncompiled"].engine.runner
    assert not uncompiled.graphs.token_sizes and uncompiled.graphs.pieces is None  # FULL graphs only
    assert uncompiled.graphs.full_keys() == engines["full"].engine.runner.graphs.full_keys()
    assert type(uncompiled.model).__name__ != "OptimizedModule" and not engines["uncompiled"].config.torch_compile
    pieces = engines["eager_pieces"].engine.runner.graphs  # the same graphs as the default, of uncompiled pieces
    assert type(engines["eager_pieces"].engine.runner.model).__name__ == "UnfusedTrace"
    assert pieces.full_keys() == engines["full"].engine.runner.graphs.full_keys()
    assert pieces.token_sizes == engines["full"].engine.runner.graphs.token_sizes


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_eager_piecewise_full_give_identical_tokens(engines: dict[str, LLM], batch: int) -> None:
    prompts = _prompts(batch, batch)
    results = {}
    for name, llm in engines.items():
        before = _counts(llm)
        results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
        after = _counts(llm)
        ran = {mode: after.get(mode, 0) - before.get(mode, 0) for mode in StepMode}
        if name in ("full", "eager_pieces"):
            # decodes run FULL; only a prefill over the largest token bucket (2048) runs without graphs
            assert ran[StepMode.FULL] >= NEW_TOKENS - 2 and ran[StepMode.EAGER] <= 1, ran
        if name == "uncompiled":  # decodes run FULL, prefills without graphs
            assert ran[StepMode.FULL] >= NEW_TOKENS - 2 and ran[StepMode.PIECEWISE] == 0, ran
        if name == "piecewise":
            assert ran[StepMode.FULL] == 0 and ran[StepMode.PIECEWISE] >= NEW_TOKENS - 1, ran  # big prefills: eager
    assert results["piecewise"] == results["eager"]
    assert results["full"] == results["eager"]
    assert results["uncompiled"] == results["eager"]
    assert results["eager_pieces"] == results["eager"]
    for name in ("piecewise", "full", "eager_pieces"):
        pieces = engines[name].engine.runner.graphs.pieces
        assert not any(p.moved_input_calls or p.uncaptured_calls for p in pieces), name


def test_mixed_prefill_and_decode_steps_identical(engines: dict[str, LLM]) -> None:
    mixed_before = {n: engines[n].engine.runner.graphs.mixed_steps for n in ("full", "uncompiled", "eager_pieces")}
    results = {name: _staggered(llm) for name, llm in engines.items()}
    for n, before in mixed_before.items():  # small prefill steps: mixed FULL graphs
        assert engines[n].engine.runner.graphs.mixed_steps > before, n
    assert len(results["eager"]) == 19
    assert results["piecewise"] == results["eager"]
    assert results["full"] == results["eager"]
    assert results["uncompiled"] == results["eager"]
    assert results["eager_pieces"] == results["eager"]


def test_seeded_and_filtered_sampling_identical_across_modes(engines: dict[str, LLM]) -> None:
    """Seeded temperature batches are "plain" and run FULL (Gumbel noise inside the graph); top-k/top-p,
    penalties and logprobs run PIECEWISE. The noise is a function of (seed, position), so every mode
    draws the same tokens and reports the same logprobs."""
    prompts = _prompts(13, 7)
    plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=NEW_TOKENS, ignore_eos=True) for i in range(13)]
    filtered = [SamplingParams(temperature=0.9, seed=i, top_k=20, top_p=0.8, repetition_penalty=1.2, logprobs=3,
                               max_tokens=NEW_TOKENS, ignore_eos=True) for i in range(13)]
    results = {}
    for name, llm in engines.items():
        before = _counts(llm)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
        middle = _counts(llm)
        outs = llm.generate(prompts, filtered)
        after = _counts(llm)
        if name in ("full", "uncompiled", "eager_pieces"):
            assert middle.get(StepMode.FULL, 0) - before.get(StepMode.FULL, 0) >= NEW_TOKENS - 2
            assert after.get(StepMode.FULL, 0) == middle.get(StepMode.FULL, 0)  # filtered batches never run FULL
        results[name] = (tokens, [o.outputs[0].token_ids for o in outs],
                         [[sorted(d) for d in o.outputs[0].logprobs] for o in outs])
    assert results["piecewise"] == results["eager"]
    assert results["full"] == results["eager"]
    assert results["uncompiled"] == results["eager"]
    assert results["eager_pieces"] == results["eager"]


def test_penalised_batches_run_full_and_match_every_mode(engines: dict[str, LLM]) -> None:
    """Penalties (from the persistent statistics) are part of the FULL graphs' sampling: a batch of penalised
    greedy and seeded requests beside neutral ones replays FULL graphs, and every mode draws the same tokens; the
    statistics are updated by the post-update inside the graph."""
    prompts = _prompts(11, 9)
    kinds = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.8, "frequency_penalty": 0.5}, {},
             {"repetition_penalty": 0.7, "frequency_penalty": 1.2}]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=3 * NEW_TOKENS, ignore_eos=True,
                             **kinds[i % len(kinds)]) for i in range(11)]
    results = {}
    for name, llm in engines.items():
        before = _counts(llm)
        results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name in ("full", "uncompiled", "eager_pieces"):
            assert _counts(llm).get(StepMode.FULL, 0) - before.get(StepMode.FULL, 0) >= 3 * NEW_TOKENS - 2
    assert results["piecewise"] == results["eager"]
    assert results["full"] == results["eager"]
    assert results["uncompiled"] == results["eager"]
    assert results["eager_pieces"] == results["eager"]
    plain = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=True)
             for p in params]
    assert [o.outputs[0].token_ids for o in engines["eager"].generate(prompts, plain)] != results["eager"]


def test_padded_rows_write_no_kv(model_dir: Path) -> None:
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, device="cuda", num_gpu_blocks_override=64)
    kv = llm.engine.runner.kv_cache  # [L, 2, num_blocks, block_size, Hkv, D]
    sentinel = 1234.5
    kv.fill_(sentinel)
    before = _counts(llm)
    prompts = _prompts(7, 7, 5, 5)  # 7 requests: FULL decodes padded to 8 rows
    llm.generate(prompts, _greedy(8))
    assert _counts(llm)[StepMode.FULL] - before.get(StepMode.FULL, 0) >= 6
    touched = (kv != sentinel).flatten(3).any(-1).any(1).any(0)  # [num_blocks] bool
    blocks = set(touched.nonzero().flatten().tolist())
    # each request holds 5 + 8 tokens = one 16-slot block; the null block 0 (the padding row's table) is untouched
    assert 0 not in blocks and len(blocks) == 7, sorted(blocks)


@pytest.mark.parametrize("mode", ["full", "uncompiled", "eager_pieces"])
def test_graph_step_loop_never_synchronises(model_dir: Path, mode: str) -> None:
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, device="cuda", max_num_batched_tokens=48,
              **MODES[mode])
    SyncFreeLaunches(llm.engine)
    params = [SamplingParams(temperature=t, max_tokens=16, ignore_eos=True, seed=i)
              for i, t in enumerate([0.0, 0.8] * 6)]
    outs = llm.generate(_prompts(12, 5, 3, 60), params)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    counts = _counts(llm)
    # the compiled engine's other steps replay piecewise graphs; the uncompiled engine's run without graphs
    assert counts.get(StepMode.FULL, 0) > 0 and (counts.get(StepMode.PIECEWISE, 0) > 0) == (mode != "uncompiled"), \
        counts


def test_cache_hit_suffix_runs_one_mixed_graph_with_split_kv(tmp_path: Path) -> None:
    """A short suffix over a long cached prefix (the prefix-cache hit of BENCHMARKS.md P1, scaled down) runs as
    one mixed FULL replay whose attention splits the long context, and gives the eager engine's tokens."""
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM", max_position_embeddings=4096)
    kw = {"dtype": "float32", "max_model_len": 2048, "device": "cuda", "max_num_seqs": 8}
    eager = LLM(model=model_dir, enforce_eager=True, **kw)
    full = LLM(model=model_dir, **kw)
    manager = full.engine.runner.graphs
    assert any(k[3] and k[2] > 1 for k in manager.full_keys())  # a mixed graph with split-KV attention
    rng = random.Random(5)
    prefix = [rng.randrange(512) for _ in range(1500)]
    prompts = [prefix + [rng.randrange(512) for _ in range(n)] for n in (3, 40, 61)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, _greedy())]
    full.generate(prompts[:1], _greedy(1))  # caches the prefix
    before = manager.mixed_steps
    outs = full.generate(prompts, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= 1488 for o in outs)
    assert manager.mixed_steps > before
    # a hit that leaves 2 to 8 tokens, alone: the mixed graph of its piecewise bucket (2, 4, 8), not piecewise
    for n in (2, 3, 5, 8):
        short = prefix[:1488] + [rng.randrange(512) for _ in range(n)]
        mixed, piecewise = manager.mixed_steps, manager.mode_counts[StepMode.PIECEWISE]
        out = full.generate([short], _greedy())[0]
        assert out.num_cached_tokens == 1488
        assert manager.mixed_steps == mixed + 1 and manager.mode_counts[StepMode.PIECEWISE] == piecewise, n
        assert out.outputs[0].token_ids == eager.generate([short], _greedy())[0].outputs[0].token_ids, n


def test_many_split_graphs_over_short_contexts_give_eagers_tokens(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """At a max_model_len whose batch-1 decode graph splits the KV range 16 ways, contexts of 40-300 keys replay
    that graph with most splits empty (they store no partial; the merge skips them) and keep the eager engine's
    tokens, alone and batched."""
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM", max_position_embeddings=4096)
    kw = {"dtype": "float32", "max_model_len": 2048, "device": "cuda", "max_num_seqs": 4}
    eager = LLM(model=model_dir, enforce_eager=True, **kw)
    full = LLM(model=model_dir, **kw)
    manager = full.engine.runner.graphs
    assert manager._long_splits(1) == 16
    seen: list[tuple[int, int]] = []
    replay = manager.replay_full
    monkeypatch.setattr(manager, "replay_full", lambda plan: (seen.append((plan.num_reqs, plan.num_splits)),
                                                              replay(plan))[1])
    rng = random.Random(11)
    for lengths in ([40], [150], [300], [150, 300, 40]):
        prompts = [[rng.randrange(512) for _ in range(n)] for n in lengths]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, _greedy())]
        assert [o.outputs[0].token_ids for o in full.generate(prompts, _greedy())] == want, lengths
    assert (1, 16) in seen, sorted(set(seen))
