"""The small-M GEMV inside the engine (`-m gpu`): with every linear of a tiny bf16 Qwen3 routed to it (a tuned
table built from the model's shapes), compiled without graphs, PIECEWISE and FULL give identical greedy tokens (batches at, below
and above its 8-token limit, prompts from 2 tokens), the Triton kernel really runs, and its tokens sit within the
cuBLAS engine's top-5 at the first divergence; all of it again with the layer norms in the GEMV's prologue, with
the MLP's activation in the down projection's prologue, and with the gate-up GEMV's activation epilogue
(GRAPHRUNNER_GEMV_GATED_ACT: the swapped tensor-core configs, the MLP as one op).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.models import gate_up_act, gemv

pytestmark = pytest.mark.gpu

# compiled without graphs is the reference: bf16 plain-PyTorch eager rounds its norms differently from Inductor
MODES = {"compiled": {"cudagraph_mode": "none"}, "piecewise": {"cudagraph_mode": "piecewise"}, "full": {}}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemv"), "Qwen3ForCausalLM")


def _table(model_dir: Path, swap_ab: bool = False) -> dict[tuple[int, int], tuple[gemv.GemvConfig, ...]]:
    """Configs (split-K where K allows, so the counters run too) for every 2-D weight of the checkpoint."""
    from safetensors import safe_open

    shapes: set[tuple[int, int]] = set()
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            shapes |= {tuple(st.get_slice(k).get_shape()) for k in st.keys()  # noqa: SIM118
                       if k.endswith("proj.weight")}
    # fused qkv / gate_up weights stack the HF projections' rows
    cfg = json.loads((model_dir / "config.json").read_text())
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shapes |= {((cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * d, h),
               (2 * cfg["intermediate_size"], h)}
    # the row loop up to 2 tokens, tensor cores from 3 to 8: both paths and the boundary between them run (swapped:
    # one K split, so the gate-up weight's config is fusable)
    dot = gemv.GemvConfig(32, 32, 1, max_m=8, use_dot=True, swap_ab=True) if swap_ab else None
    return {s: (gemv.GemvConfig(4, 32, 2 if s[1] >= 64 else 1, max_m=2),
                dot or gemv.GemvConfig(16, 32, 2 if s[1] >= 64 else 1, max_m=8, use_dot=True)) for s in shapes}


@pytest.fixture(scope="module", params=["gemv", "gemv_norm_prologue", "gemv_act_prologue", "gemv_gated_act"])
def gemv_calls(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[list[int]]:
    """The GEMV routed for every weight; the second pass also folds the layer norms into its prologue
    (GRAPHRUNNER_GEMV_NORM), the third the MLP's silu(gate) * up into the down projection's (GRAPHRUNNER_GEMV_ACT),
    the fourth runs the MLP as one op with the activation in the gate-up kernel's epilogue. [GEMV calls, fused
    gate-up calls, 1 where the fused kernel should run]."""
    gated = request.param == "gemv_gated_act"
    calls = [0, 0, int(gated)]
    table = _table(model_dir, swap_ab=gated)

    def counting(index: int, fn: object) -> object:
        def wrapper(*args: object, **kwargs: object) -> object:
            calls[index] += 1
            return fn(*args, **kwargs)  # type: ignore[operator]
        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemv, "ENABLED", True)
        mp.setattr(gemv, "NORM_PROLOGUE", request.param == "gemv_norm_prologue")
        mp.setattr(gemv, "ACT_PROLOGUE", request.param in ("gemv_act_prologue", "gemv_gated_act"))
        mp.setattr(gate_up_act, "ENABLED", gated)
        mp.setattr(gemv, "tuned_configs", lambda: table)
        mp.setattr(gemv, "gemv_triton", counting(0, gemv.gemv_triton))
        mp.setattr(gate_up_act, "gate_up_act_triton", counting(1, gate_up_act.gate_up_act_triton))
        yield calls


@pytest.fixture(scope="module")
def engines(model_dir: Path, gemv_calls: list[int]) -> dict[str, LLM]:
    return {name: LLM(model=model_dir, dtype="bfloat16", max_model_len=256, device="cuda", **kw)
            for name, kw in MODES.items()}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(2, 30))] for _ in range(n)]


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_modes_identical_with_gemv(engines: dict[str, LLM], gemv_calls: list[int], batch: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before, fused_before = gemv_calls[0], gemv_calls[1]
    results = {name: [o.outputs[0].token_ids for o in llm.generate(_prompts(batch, batch), params)]
               for name, llm in engines.items()}
    if batch <= gemv.MAX_M:
        assert gemv_calls[0] > before  # decode steps went through the Triton GEMV (above 8 tokens: cuBLAS)
    if gemv_calls[2] and 3 <= batch <= gemv.MAX_M:
        assert gemv_calls[1] > fused_before  # the tensor-core configs serve 3-8 tokens: the MLP ran fused
    assert results["piecewise"] == results["compiled"]
    assert results["full"] == results["compiled"]


def test_gemv_tokens_within_cublas_top5(model_dir: Path, engines: dict[str, LLM],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(4, 7)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    ours = [o.outputs[0].token_ids for o in engines["compiled"].generate(prompts, params)]
    monkeypatch.setattr(gemv, "ENABLED", False)
    monkeypatch.setattr(gemv, "NORM_PROLOGUE", False)
    monkeypatch.setattr(gemv, "ACT_PROLOGUE", False)
    monkeypatch.setattr(gate_up_act, "ENABLED", False)
    ref_llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=256, device="cuda", **MODES["compiled"])
    refs = ref_llm.generate(prompts, params)
    for toks, ref in zip(ours, refs):
        ref_toks = ref.outputs[0].token_ids
        diverge = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), None)
        if diverge is not None:
            top5 = ref.outputs[0].logprobs[diverge]
            assert toks[diverge] in top5, (diverge, toks[diverge], list(top5))
