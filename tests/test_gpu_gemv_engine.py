"""The small-M GEMV inside the engine (`-m gpu`, GRAPHRUNNER_GEMV switched on in-process): eager, PIECEWISE and
FULL give identical greedy tokens in bf16 (batches at, below and above the GEMV's 8-token limit), the Triton op
really runs, and its tokens sit within the cuBLAS engine's top-5 at the first divergence.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.models import gemv, linear

pytestmark = pytest.mark.gpu

MODES = {"eager": {"enforce_eager": True}, "piecewise": {"cudagraph_mode": "piecewise"}, "full": {}}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemv"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def gemv_calls() -> Iterator[list[int]]:
    calls = [0]
    original = gemv.gemv_triton

    def counting(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "GEMV_ENABLED", True)
        mp.setattr(gemv, "gemv_triton", counting)
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
    before = gemv_calls[0]
    results = {name: [o.outputs[0].token_ids for o in llm.generate(_prompts(batch, batch), params)]
               for name, llm in engines.items()}
    assert gemv_calls[0] > before  # eager decode steps went through the Triton GEMV
    assert results["piecewise"] == results["eager"]
    assert results["full"] == results["eager"]


def test_gemv_tokens_within_cublas_top5(model_dir: Path, engines: dict[str, LLM],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(4, 7)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    ours = [o.outputs[0].token_ids for o in engines["eager"].generate(prompts, params)]
    monkeypatch.setattr(linear, "GEMV_ENABLED", False)
    ref_llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=256, device="cuda", enforce_eager=True)
    refs = ref_llm.generate(prompts, params)
    for toks, ref in zip(ours, refs):
        ref_toks = ref.outputs[0].token_ids
        diverge = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), None)
        if diverge is not None:
            top5 = ref.outputs[0].logprobs[diverge]
            assert toks[diverge] in top5, (diverge, toks[diverge], list(top5))
