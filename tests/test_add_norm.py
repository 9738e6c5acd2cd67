"""The decoder's residual add and the norm after it in one op (graphrunner::add_rms_norm, GRAPHRUNNER_FUSED_ADD_NORM):
the Triton kernel against the PyTorch reference on awkward sizes (the sum bit-equal, the norm within rounding), bad
input, opcheck, and engines with it on: on CPU the same greedy tokens and logprobs as with it off (the same
additions in the same order) for Qwen3, Llama and Qwen2; on a GPU, graphs give the compiled engine's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams
from graphrunner.models import norm as norm_mod
from graphrunner.models.norm import add_rms_norm_ref, add_rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
       torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


def _data(t: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype).to(DEVICE)
    r = (torch.randn(t, d, generator=g) * 4).to(dtype).to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE)
    return x, r, w


@pytest.mark.parametrize(("t", "d"), [(0, 16), (1, 1), (3, 7), (5, 100), (2, 1000), (17, 1024)])
def test_kernel_matches_reference(t: int, d: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, r, w = _data(t, d, dtype, seed=t * 31 + d)
        normed, summed = add_rms_norm_triton(x, r, w, 1e-6)
        ref_normed, ref_summed = add_rms_norm_ref(x, r, w, 1e-6)
        assert normed.shape == summed.shape == (t, d) and normed.dtype == summed.dtype == dtype
        if DEVICE == "cuda" or dtype != torch.bfloat16:  # (the interpreter's bf16 cast may not round to nearest)
            assert torch.equal(summed, ref_summed)  # one float32 add of the two values, rounded: PyTorch's add
        # bf16 under the interpreter: its casts may truncate, so two roundings can land two ulps apart
        tol = {"rtol": 4e-2, "atol": 1e-2} if DEVICE == "cpu" and dtype == torch.bfloat16 else TOL[dtype]
        torch.testing.assert_close(summed, ref_summed, **tol)
        torch.testing.assert_close(normed, ref_normed, **tol)


def test_bad_input_is_refused() -> None:
    x, r, w = _data(2, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm_triton(x, r[:, :4].contiguous(), w, 1e-6)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm_triton(x, r, w[:4], 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm_triton(x, r.half(), w, 1e-6)


def test_op_matches_reference_and_passes_opcheck() -> None:
    x, r, w = _data(4, 24, torch.float32, seed=3)
    op = torch.ops.graphrunner.add_rms_norm
    normed, summed = op(x, r, w, 1e-6)
    ref_normed, ref_summed = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, **TOL[torch.float32])
    torch.library.opcheck(op.default, (x, r, w, 1e-6), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_cpu_engine_same_tokens_and_logprobs_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         arch: str) -> None:
    model_dir = make_tiny_model(tmp_path, arch)
    prompts = [[5, 6, 7, 8, 9], [100, 7, 8] * 9, [3]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = []
    for on in (False, True):
        monkeypatch.setattr(norm_mod, "FUSED_ADD_NORM", on)
        llm = LLM(model=model_dir, device="cpu", max_model_len=128)
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, [{k: v.logprob for k, v in step.items()}
                                                   for step in o.outputs[0].logprobs]) for o in outs])
        del llm
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graphs_equal_compiled_with_the_fused_add_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    monkeypatch.setattr(norm_mod, "FUSED_ADD_NORM", True)
    calls = [0]
    original = norm_mod.add_rms_norm_triton

    def counting(*args: object) -> object:
        calls[0] += 1
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(norm_mod, "add_rms_norm_triton", counting)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 7, 8, 9, 10] * 40, [3]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for mode, kw in {"compiled": {"cudagraph_mode": "none"}, "piecewise": {"cudagraph_mode": "piecewise"},
                     "full": {}}.items():
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=512, device="cuda", **kw)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert calls[0] > 0  # the kernel ran
    assert tokens["piecewise"] == tokens["compiled"]
    assert tokens["full"] == tokens["compiled"]


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("GRAPHRUNNER_FUSED_ADD_NORM", "on", "GRAPHRUNNER_FUSED_ADD_NORM must be one of 0, 1"),
    ("GRAPHRUNNER_ADD_NORM_WARPS", "3", "GRAPHRUNNER_ADD_NORM_WARPS must be an integer in (1, 2, 4, 8, 16)"),
])
def test_bad_switch_value_is_refused(name: str, raw: str, message: str) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, name: raw}
    got = subprocess.run([sys.executable, "-c", "import graphrunner.models.norm"], env=env, capture_output=True,
                         text=True, check=False, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert got.returncode != 0 and message in got.stderr, got.stderr
