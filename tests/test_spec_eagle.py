"""EAGLE-1 speculative decoding on CPU (tiny fp32 models, async engine, random-weight heads saved in vLLM's layout).

* The head's forward equals a plain PyTorch reference (fc + one decoder layer + the target's LM head).
* Every draft the engine writes equals the reference head run over the whole accepted history with the target's
  HF hidden states (checks the head's paged KV, positions and token shift), under chunked prefill, preemption and
  batch-size disabling.
* Greedy outputs equal those without speculation at k = 1, 3, 5, plainly, under chunked prefill and forced
  preemption, for a random head (drafts mostly rejected) and an exact head (every draft must be accepted).
* The FULL bodies (run without graphs on CPU) give the eager tokens; bad heads are refused with ValueErrors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from sync_check import SyncFreeLaunches
from tiny_eagle import make_attention_free_pair, make_eagle_head
from tiny_models import make_tiny_model, model_state_for
from tool_loader import load_tool

from capture.manager import CaptureManager
from graphrunner import LLM, SamplingParams
from graphrunner.attention import forward_context
from graphrunner.attention.testing import contiguous_batch
from graphrunner.loader import load_model
from graphrunner.step_plan import StepBodies, StepMode, StepPlan
from model_states.eagle import EagleModelState

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINES: dict[str, dict[str, Any]] = {
    "plain": {"num_gpu_blocks_override": 256},
    "chunked": {"num_gpu_blocks_override": 256, "max_num_batched_tokens": 11},
    "preempt": {"num_gpu_blocks_override": 11, "block_size": 8},
}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 400) for _ in range(n)] for n in (1, 4, 9, 17, 30, 47)]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _spec(head: Path, k: int, **extra: object) -> dict[str, object]:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k, **extra}


# -- a plain PyTorch reference of the head ------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] at positions 0..T-1, HF's rotate_half layout."""
    t, d = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_head(w: dict[str, torch.Tensor], cfg: dict[str, Any], embeds: torch.Tensor,
                   hidden: torch.Tensor) -> torch.Tensor:
    """The EAGLE-1 head over one sequence at positions 0..T-1 (embeds / hidden [T, H]) -> [T, H]: fc on the concat,
    a Llama layer without its input norm (causal attention written out), no final norm."""
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, t = cfg["rms_norm_eps"], embeds.shape[0]
    theta = cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"]  # transformers 4 / 5
    x = torch.cat((embeds, hidden), dim=-1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    p = "layers.0."
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, d), theta)
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, d), theta)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)  # [T, nh, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * d)
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    n = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T)
    return x + mlp @ w[p + "mlp.down_proj.weight"].T


class _Reference:
    """Reference drafts: the target's HF final hidden states over a history, then the head autoregressively."""

    def __init__(self, target: Path, head: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.w = load_file(str(head / "model.safetensors"))
        self.cfg = json.loads((head / "config.json").read_text())
        self.embed = self.hf.model.embed_tokens.weight.detach()  # [V, H], shared with the head
        self.lm_head = self.hf.lm_head.weight.detach()  # [V, H]

    @torch.no_grad()
    def drafts(self, history: list[int], k: int) -> list[int]:
        ids = torch.tensor([history])
        feats = self.hf.model(ids).last_hidden_state[0]  # [n, H] after the final norm, as vLLM's EAGLE reads them
        embeds, hidden = self.embed[ids[0, 1:]], feats[:-1]  # position p: token p + 1 with the feature at p
        out: list[int] = []
        for _ in range(k):
            last = reference_head(self.w, self.cfg, embeds, hidden)[-1]  # [H]
            tok = int((self.lm_head @ last).argmax())
            out.append(tok)
            embeds = torch.cat((embeds, self.embed[tok][None]))
            hidden = torch.cat((hidden, last[None]))
        return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    root = tmp_path_factory.mktemp("eagle_llama")
    target = make_tiny_model(root, "LlamaForCausalLM")
    head = make_eagle_head(root, target, fc_bias=True)
    return target, head, _tokens(LLM(model=target, num_gpu_blocks_override=256))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    root = tmp_path_factory.mktemp("eagle_qwen3")
    target = make_tiny_model(root, "Qwen3ForCausalLM")
    head = make_eagle_head(root, target, seed=1, architecture="EagleQwen3ForCausalLM")
    return target, head, _tokens(LLM(model=target, num_gpu_blocks_override=256))


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    target, head = make_attention_free_pair(tmp_path_factory.mktemp("eagle_exact"))
    return target, head, _tokens(LLM(model=target, num_gpu_blocks_override=256))


# -- the head ----------------------------------------------------------------------------------------------------
def test_head_forward_matches_plain_reference(llama: tuple[Path, Path, list]) -> None:
    target_dir, head_dir, _ = llama
    target = load_model(target_dir, model_state_for(target_dir), torch.float32, "cpu")
    state = EagleModelState.from_dir(head_dir, target.config, block_size=4)
    assert state.fc_bias and state.flags.qk_norm is False
    head = load_model(head_dir, state, torch.float32, "cpu")
    cfg = state.config
    t = 11  # not a multiple of the block size: a partly filled last block
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (t,))
    hidden = torch.randn(t, cfg.hidden_size)
    meta, kv = contiguous_batch([t], [t], 1, cfg.num_kv_heads, cfg.head_dim, 4, torch.float32, "cpu")
    with torch.no_grad(), forward_context(meta, kv, "reference"):
        got = target.compute_logits(head(target.embed_input_ids(ids), hidden, torch.arange(t)))  # [T, V]
    ref_cfg = json.loads((head_dir / "config.json").read_text())
    w = load_file(str(head_dir / "model.safetensors"))
    tw = load_file(str(target_dir / "model.safetensors"))
    want = reference_head(w, ref_cfg, tw["model.embed_tokens.weight"][ids], hidden) @ tw["lm_head.weight"].T
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # the checkpoint's own embedding copy is not the one used: the target's is
    assert not torch.equal(w["embed_tokens.weight"], tw["model.embed_tokens.weight"])


def _record_drafts(llm: LLM, k: int) -> list[tuple[list[int], list[int]]]:
    """Spy on the engine's EAGLE proposer: after each proposal that drafted, (history, k drafts) of every row that
    just sampled (the list fills as the engine runs)."""
    proposer = llm.engine.runner.proposer
    state = proposer.state
    max_len = state.token_ids.shape[1]
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def spy(idx_mapping: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        propose(idx_mapping, *args, **kwargs)
        if not (args[3] if len(args) > 3 else kwargs.get("draft", True)):
            return
        for row in idx_mapping.tolist():
            nc, nt = int(state.num_computed[row]), int(state.num_tokens[row])
            if nt == nc + 1 and nt + k <= max_len:  # a row that just sampled (not one mid-prefill)
                seen.append((state.token_ids[row, :nt].tolist(), state.token_ids[row, nt:nt + k].tolist()))

    proposer.propose = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("engine", ["chunked", "preempt", "prefix", "triton"])
def test_engine_drafts_equal_the_reference_head(llama: tuple[Path, Path, list], engine: str) -> None:
    """After every proposal, each decoding row's k drafts equal the reference head's over its accepted history.
    "prefix": a second batch shares whole blocks with the first but continues with other tokens (the head's KV at
    a hit block's last position came from the first batch's next token: that block must be recomputed). "triton":
    chunked, with the step kernels (the draft steps' advance among them) in Triton, as on CUDA (the interpreter
    here)."""
    target, head, _ = llama
    k = 3
    kwargs = ({"num_gpu_blocks_override": 256, "block_size": 4} if engine == "prefix"
              else {**ENGINES["chunked"], "use_triton": True} if engine == "triton"
              else {**ENGINES[engine], "enable_prefix_caching": False})
    llm = LLM(model=target, speculative_config=_spec(head, k), **kwargs)
    seen = _record_drafts(llm, k)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 16, 20, 24)]
    _tokens(llm, params)
    if engine == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    if engine == "prefix":
        rng = random.Random(9)
        again = [{"prompt_token_ids": p[:12] + [rng.randrange(1, 400) for _ in range(3)]} for p in _prompts()[3:]]
        llm.generate(again, params[:3], use_tqdm=False)
        assert llm.engine.stats._prefix_hits > 0
    assert len(seen) > 20
    ref = _Reference(target, head)
    for history, drafts in seen:
        assert drafts == ref.drafts(history, k), f"history of {len(history)} tokens"


def test_disable_by_batch_size_leaves_the_head_idle(llama: tuple[Path, Path, list]) -> None:
    """disable_by_batch_size=4, six requests: in a step with four or more running the head does not run at all,
    and those requests never draft again (the head's KV has a gap), though their tokens are exact. A request
    admitted later whose prompt repeats one of theirs, outputs included, recomputes the blocks filled while the
    head was idle (partial prefix-cache hits), so its drafts equal the reference head's."""
    target, head, ref_tokens = llama
    k = 3
    llm = LLM(model=target, speculative_config=_spec(head, k, disable_by_batch_size=4), num_gpu_blocks_override=256,
              block_size=4)
    runner = llm.engine.runner
    seen = _record_drafts(llm, k)
    active, idle_calls, propose = [True], [0], runner.proposer.propose
    execute = runner.execute

    def step(sched: Any) -> Any:
        active[0] = sched.spec_active
        return execute(sched)

    def counted(*args: Any, **kwargs: Any) -> None:
        idle_calls[0] += not active[0]
        propose(*args, **kwargs)

    runner.execute = step  # type: ignore[method-assign]
    runner.proposer.propose = counted  # type: ignore[method-assign]
    head_forwards, run_head = [0], runner.proposer._head

    def counted_head(*args: Any, **kwargs: Any) -> Any:
        head_forwards[0] += not active[0]
        return run_head(*args, **kwargs)

    runner.proposer._head = counted_head  # type: ignore[method-assign]
    assert _tokens(llm) == ref_tokens
    assert idle_calls[0] == 0 and head_forwards[0] == 0
    assert llm.engine.stats.spec_decode_counts[0] == 0  # all six ran while it was off: no verify step
    assert seen  # the first step (nothing running yet) drafted, as did the steps after four had finished
    seen.clear()
    longest = _prompts()[-1] + ref_tokens[-1][:14]  # 61 tokens: the last 14 positions were filled while idle
    hits = llm.engine.stats._prefix_hits
    out = llm.generate([{"prompt_token_ids": longest}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats._prefix_hits > hits and llm.engine.stats.spec_decode_counts[0] > 0
    assert len(seen) > 3
    ref = _Reference(target, head)
    for history, drafts in seen:
        assert drafts == ref.drafts(history, k), f"history of {len(history)} tokens"
    assert out == LLM(model=target, num_gpu_blocks_override=256).generate(
        [{"prompt_token_ids": longest}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


# -- end to end --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_exact_head_accepts_everything_and_matches(exact: tuple[Path, Path, list], k: int, engine: str) -> None:
    target, head, ref = exact
    llm = LLM(model=target, speculative_config=_spec(head, k), **ENGINES[engine])
    assert _tokens(llm) == ref
    drafts, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert drafts > 0 and draft_tokens > 0 and accepted == draft_tokens
    assert llm.engine.stats.mean_acceptance_length > 1.0
    if engine == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_batch_independent(exact: tuple[Path, Path, list]) -> None:
    """Seeded sampled requests give the same tokens alone and in a batch with EAGLE drafting (the Gumbel key is
    per logits row and position, so neither the batch nor the accepted counts of neighbours change a draw)."""
    target, head, _ = exact
    llm = LLM(model=target, speculative_config=_spec(head, 3), num_gpu_blocks_override=256)
    prompts = _prompts()
    params = [SamplingParams(temperature=0.1 if i % 2 else 0.4, top_k=20, max_tokens=NEW_TOKENS, ignore_eos=True,
                             seed=100 + i) for i in range(len(prompts))]
    together = _tokens(llm, params)
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params)]
    assert together == alone
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert draft_tokens > 0 and accepted > 0  # sampled requests did verify drafts


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_random_head_matches(request: pytest.FixtureRequest, case: str, k: int, engine: str) -> None:
    target, head, ref = request.getfixturevalue(case)
    llm = LLM(model=target, speculative_config=_spec(head, k), **ENGINES[engine])
    assert _tokens(llm) == ref
    drafts, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted < draft_tokens
    if engine == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


# -- FULL bodies -------------------------------------------------------------------------------------------------
class _GraphlessFull(CaptureManager):
    """Plans like the real manager, but 'replays' by running the FULL body eagerly (CPU has no graphs)."""

    bodies: StepBodies
    verify_replays: int = 0

    def replay_full(self, plan: StepPlan) -> Any:
        if not plan.mixed and plan.num_tokens > plan.num_reqs:
            self.verify_replays += 1
        return self.bodies.full_step(plan.num_reqs, plan.num_tokens, plan.num_splits, plan.mixed)


def test_full_bodies_draft_with_the_head(exact: tuple[Path, Path, list]) -> None:
    """The head inside the FULL bodies (observe, k drafts): the exact head keeps every draft accepted."""
    target, head, ref = exact
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 60, "max_model_len": 96, "max_num_seqs": 8,
                              "speculative_config": _spec(head, 3)}
    llm = LLM(model=target, **kwargs)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len)
    manager.bodies = runner.capture_bodies()
    runner.graphs = manager
    assert _tokens(llm) == ref
    assert manager.verify_replays >= 4
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert draft_tokens > 0 and accepted == draft_tokens


def test_full_bodies_draft_what_the_reference_head_drafts(llama: tuple[Path, Path, list]) -> None:
    """Every step through the FULL bodies (verify graphs, a mixed graph for the admission, Triton attention as on a
    GPU, interpreted here) with a random head: each draft equals the reference head's over the accepted history,
    so the head's KV positions and the draft steps inside a graph are the eager path's (the attention-free pair
    above accepts every draft whatever its attention reads)."""
    target, head, ref_tokens = llama
    k = 3
    llm = LLM(model=target, speculative_config=_spec(head, k), num_gpu_blocks_override=60, max_model_len=96,
              max_num_seqs=8, attention_backend="triton", use_triton=True)
    runner = llm.engine.runner
    manager = _GraphlessFull(runner.model_state, runner.buffers, None, [1, 2, 8], [], runner.max_model_len, [(8, 128)])
    manager.bodies = runner.capture_bodies()
    runner.graphs = manager
    seen = _record_drafts(llm, k)
    n = 12
    assert _tokens(llm, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)) == [r[:n] for r in ref_tokens]
    assert manager.verify_replays >= 5 and manager.mixed_steps >= 1
    # min_tokens: its first decodes have no draft slots, so they replay the plain-decode graph, which only observes
    # with the head; the drafts after them read the KV those steps wrote
    before = manager.mode_counts[StepMode.FULL]
    alone = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=5, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": _prompts()[4]}], alone, use_tqdm=False)[0].outputs[0].token_ids == \
        ref_tokens[4][:n]
    assert manager.mode_counts[StepMode.FULL] - before >= 6
    real = [(history, drafts) for history, drafts in seen if len(history) >= 2]  # not the padding rows
    assert len(real) > 15 and any(len(h) > len(_prompts()[4]) + 5 for h, _ in real[-3:])
    ref = _Reference(target, head)
    for history, drafts in real:
        assert drafts == ref.drafts(history, k), f"history of {len(history)} tokens"


# -- refusals ----------------------------------------------------------------------------------------------------
def test_bad_heads_are_refused(llama: tuple[Path, Path, list], tmp_path: Path) -> None:
    target, _, _ = llama
    with pytest.raises(ValueError, match="not an EAGLE head directory"):
        LLM(model=target, speculative_config=_spec(tmp_path / "missing", 2))
    wide = make_eagle_head(tmp_path, target, hidden_size=96)
    with pytest.raises(ValueError, match=r"hidden size \(96\) differs from the target's \(64\)"):
        LLM(model=target, speculative_config=_spec(wide, 2))
    with pytest.raises(ValueError, match="no 'fc.weight'"):  # a plain model is not a head
        LLM(model=target, speculative_config=_spec(target, 2))
    odd = make_eagle_head(tmp_path / "odd", target, architecture="EagleGPT2ForCausalLM")
    with pytest.raises(ValueError, match="EagleGPT2ForCausalLM.*not supported"):
        LLM(model=target, speculative_config=_spec(odd, 2))
    with pytest.raises(ValueError, match="method 'eagle' needs it"):
        LLM(model=target, speculative_config={"method": "eagle", "num_speculative_tokens": 2})


# -- GPU: FULL verify graphs record the head -----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3, 5])
def test_gpu_eagle_graphs_on_equal_eager(tmp_path: Path, k: int) -> None:
    """CUDA graphs on (FULL verify graphs hold the head's observation and k drafts) give the greedy tokens of the
    eager engine without speculation; the exact head keeps (almost) every draft; the step loop never syncs."""
    from graphrunner.step_plan import StepMode

    kwargs: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "device": "cuda", "max_num_seqs": 16}
    target = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    head = make_eagle_head(tmp_path, target, architecture="EagleQwen3ForCausalLM")
    expected = _tokens(LLM(model=target, enforce_eager=True, **kwargs))
    llm = LLM(model=target, speculative_config=_spec(head, k), **kwargs)
    assert llm.engine.runner.graphs is not None
    assert _tokens(llm) == expected
    assert llm.engine.runner.graphs.mode_counts[StepMode.FULL] > 0
    assert llm.engine.stats.spec_decode_counts[0] > 0

    exact_target, exact_head = make_attention_free_pair(tmp_path / "exact")
    expected = _tokens(LLM(model=exact_target, enforce_eager=True, **kwargs))
    llm = LLM(model=exact_target, speculative_config=_spec(exact_head, k), **kwargs)
    SyncFreeLaunches(llm.engine)
    assert _tokens(llm) == expected
    assert llm.engine.runner.graphs.mode_counts[StepMode.FULL] > 0
    _, draft_tokens, accepted = llm.engine.stats.spec_decode_counts
    assert draft_tokens > 0 and accepted > 0.95 * draft_tokens


# -- tools/train_demo_model.py train-eagle ---------------------------------------------------------------------------
def _train_tool() -> Any:
    return load_tool("train_eagle_head")


def test_train_eagle_tool_writes_a_head_the_engine_loads(qwen3: tuple[Path, Path, list], tmp_path: Path) -> None:
    """A few CPU steps of the tool's EAGLE training lower its loss; the head it saves (vLLM's layout) loads through
    the real loader and drafts, and greedy outputs stay equal (also when it trains unrolled draft steps)."""
    tool = _train_tool()
    target, _, ref = qwen3
    ids = torch.randint(1, 400, (4000,), generator=torch.Generator().manual_seed(0))
    losses = tool.train_eagle(target, ids, tmp_path / "head", 16, 4, 32, 3e-3, 0)
    assert sum(losses[-4:]) / 4 < losses[0]
    unrolled = tool.train_eagle(target, ids, tmp_path / "head3", 16, 4, 32, 3e-3, 0, unroll=3)
    assert sum(unrolled[-4:]) / 4 < unrolled[0]
    llm = LLM(model=target, num_gpu_blocks_override=256, speculative_config=_spec(tmp_path / "head3", 3))
    assert _tokens(llm) == ref
    llm = LLM(model=target, num_gpu_blocks_override=256, speculative_config=_spec(tmp_path / "head", 3))
    assert _tokens(llm) == ref
    assert llm.engine.stats.spec_decode_counts[1] > 0


@pytest.mark.parametrize(("kwargs", "named"), [({"unroll": 0}, "unroll must be >= 1"),
                                             ({"minutes": -1.0}, "minutes must be >= 0")])
def test_train_eagle_refuses_bad_settings_before_any_work(tmp_path: Path, kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        _train_tool().train_eagle(tmp_path / "no-target", torch.zeros(10, dtype=torch.long), tmp_path / "head", 1, 1,
                                  4, 1e-3, 0, **kwargs)
    assert not (tmp_path / "head").exists()


def test_train_eagle_unrolled_steps_are_the_drafting_steps(qwen3: tuple[Path, Path, list]) -> None:
    """The training-time test's step j at index i equals drafting's: the head layer over positions 0 .. i fed
    the target's features, then positions i + 1 .. i + j - 1 fed its own outputs (causal attention, HF's layer),
    read at the last position."""
    from transformers import Qwen3ForCausalLM

    tool = _train_tool()
    target_dir, _, _ = qwen3
    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    _, fc, layer = tool.new_head(target)
    fc.requires_grad_(False)
    layer.eval().requires_grad_(False)
    window = torch.randint(1, 400, (2, 13), generator=torch.Generator().manual_seed(1))
    feats = target.model(input_ids=window).last_hidden_state  # [2, 13, H]
    outs = tool.unrolled_outputs(target, fc, layer, feats, window, 3)
    assert [o.shape[1] for o in outs] == [12, 11, 10]

    def run(x: torch.Tensor) -> torch.Tensor:  # HF's layer over positions 0 .. len - 1, causal
        s = x.shape[1]
        pos = torch.arange(s)[None]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=target.model.rotary_emb(x, pos))
        return out[0] if isinstance(out, tuple) else out

    emb = target.model.embed_tokens
    for i in (0, 4, 9):
        seq = fc(torch.cat((emb(window[:, 1:i + 2]), feats[:, :i + 1]), dim=-1))  # positions 0 .. i
        last = run(seq)[:, -1]
        for j in range(1, 4):
            torch.testing.assert_close(outs[j - 1][:, i], last, rtol=1e-4, atol=1e-5)
            if j == 3:
                break
            seq = torch.cat((seq, fc(torch.cat((emb(window[:, i + j + 1]), last), dim=-1))[:, None]), dim=1)
            last = run(seq)[:, -1]
