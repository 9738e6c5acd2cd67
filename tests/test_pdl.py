"""Programmatic dependent launch (graphrunner/pdl.py, GRAPHRUNNER_PDL=1): the GEMV, the fused attention prologue
and decode attention (with its split merge) give bit-identical results with their PDL branches taken and not, on
awkward sizes; the switch never applies off CUDA; on a GPU an engine with PDL on gives the same greedy tokens as
with it off, through FULL graphs and eager (graphs capture the programmatic edges).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import greedy_tokens_off_and_on, make_tiny_model

from graphrunner import pdl
from graphrunner.attention import triton_attention
from graphrunner.attention.testing import contiguous_batch
from graphrunner.models import gemv, norm, qkv_prep
from graphrunner.models.gemv import GemvConfig, gemv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_PDL_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


QKV_PREP_HEADS = (6, 3, 20)  # (Hq, Hkv, D) of qkv_prep_case: GQA group 2, a head dim not a power of two


def qkv_prep_case(device: str) -> tuple[torch.Tensor, ...]:
    """Inputs of the q/k prologue (models.qkv_prep) for 5 tokens at QKV_PREP_HEADS, one slot -1 (padding): qkv
    [5, (Hq + 2 Hkv) D], cos and sin [5, 1, D/2], q and k norm weights [D], slots [5]; a cache [2, 7, 4, Hkv, D]
    holds every slot."""
    hq, hkv, d = QKV_PREP_HEADS
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=g).to(device)
    angles = torch.rand(5, 1, d // 2, generator=g) * 6.3
    qn, kn = ((torch.rand(d, generator=g) + 0.5).to(device) for _ in range(2))
    slots = torch.tensor([4, -1, 9, 17, 22], device=device)
    return qkv, angles.cos().to(device), angles.sin().to(device), qn, kn, slots


def _force_pdl(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Every kernel module's PDL decision, forced (CPU: the interpreter runs the PDL branches with no-op waits)."""
    for module in (gemv, qkv_prep, triton_attention, norm):
        monkeypatch.setattr(module, "use_pdl", lambda _device, on=on: on and (DEVICE == "cpu" or _PDL_CAPABLE))


def test_switch_is_on_by_default_and_never_applies_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.ENABLED or os.environ.get("GRAPHRUNNER_PDL") == "0"
    assert not pdl.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.use_pdl(torch.device("cpu"))


def test_trigger_position_by_size_and_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Early (1) below LATE_FROM tokens, late (2) from it; a named kernel late at every size; 0 without PDL."""
    monkeypatch.setattr(pdl, "LATE_FROM", 2)
    monkeypatch.setattr(pdl, "LATE_TRIGGER", frozenset({"qkv_prep"}))
    assert pdl.pdl_mode(False, "gemv", 8) == 0
    assert pdl.pdl_mode(True, "gemv", 1) == 1
    assert pdl.pdl_mode(True, "gemv", 2) == 2
    assert pdl.pdl_mode(True, "qkv_prep", 1) == 2
    monkeypatch.setattr(pdl, "LATE_FROM", 0)  # never by size
    assert pdl.pdl_mode(True, "attention", 256) == 1


@pytest.mark.parametrize(("name", "value", "message"), [
    ("GRAPHRUNNER_PDL_LATE_TRIGGER", "gemv,atention", "GRAPHRUNNER_PDL_LATE_TRIGGER must be 'all' or names among gemv"),
    ("GRAPHRUNNER_PDL_LATE_TRIGGER", "yes", "GRAPHRUNNER_PDL_LATE_TRIGGER must be 'all' or names among gemv"),
    ("GRAPHRUNNER_PDL_LATE_FROM", "-1", "GRAPHRUNNER_PDL_LATE_FROM must be an integer >= 0"),
    ("GRAPHRUNNER_PDL_LATE_FROM", "eight", "GRAPHRUNNER_PDL_LATE_FROM must be an integer >= 0"),
])
def test_bad_trigger_switches_are_refused(name: str, value: str, message: str) -> None:
    env = {**os.environ, name: value}
    proc = subprocess.run([sys.executable, "-c", "import graphrunner.pdl"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


@pytest.mark.parametrize(("m", "n", "k", "config"), [
    (1, 37, 50, None),
    (3, 40, 300, GemvConfig(16, 64, 2)),  # split-K, 3 tiles per split (the last short): only the first is
    # loaded before the wait
    (5, 33, 200, GemvConfig(32, 32, 3, use_dot=True)),
    (2, 17, 15, GemvConfig(1, 16, 1)),  # K below one tile
    (7, 20, 100, GemvConfig(4, 32, 2)),  # M = 7 rows, two tiles per split
])
def test_gemv_bit_equal_with_pdl(monkeypatch: pytest.MonkeyPatch, m: int, n: int, k: int,
                                 config: GemvConfig | None) -> None:
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=g).half().to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).half().to(DEVICE)
    b = torch.randn(n, generator=g).half().to(DEVICE)
    norm = ((torch.rand(k, generator=g) + 0.5).half().to(DEVICE), 1e-6)
    gate_up = torch.randn(m, 2 * k, generator=g).half().to(DEVICE)  # the activation prologue's input

    def outputs() -> list[torch.Tensor]:
        return [gemv_triton(x, w, b, config), gemv_triton(x, w, None, config, norm=norm),
                gemv_triton(gate_up, w, b, config, silu_mul=True)]

    _force_pdl(monkeypatch, False)
    expected = outputs()
    _force_pdl(monkeypatch, True)
    got = outputs()
    for e, o in zip(expected, got):
        assert torch.equal(e, o)


def test_add_rms_norm_bit_equal_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(3, 100, generator=g).half().to(DEVICE) for _ in range(2))
    w = (torch.rand(100, generator=g) + 0.5).half().to(DEVICE)
    results = []
    for on in (False, True):
        _force_pdl(monkeypatch, on)
        results.append(norm.add_rms_norm_triton(x, r, w, 1e-6))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_qkv_prep_bit_equal_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    hq, hkv, d = QKV_PREP_HEADS
    qkv, cos, sin, qn, kn, slots = qkv_prep_case(DEVICE)
    results = []
    for on in (False, True):
        _force_pdl(monkeypatch, on)
        cache = torch.zeros(2, 7, 4, hkv, d, device=DEVICE)
        q = qkv_prep.qkv_prep_triton(qkv, cos, sin, qn, kn, 1e-6, cache, slots, hq, hkv, d)
        results.append((q, cache))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_bit_equal_with_pdl(monkeypatch: pytest.MonkeyPatch, num_splits: int) -> None:
    hq, hkv, d, block_size = 4, 2, 16, 4
    meta, cache = contiguous_batch([1, 1, 3], [13, 1, 30], 1, hkv, d, block_size, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(5)
    cache.copy_(torch.randn(cache.shape, generator=g).to(DEVICE))
    query = torch.randn(meta.num_tokens, hq, d, generator=g).to(DEVICE)
    outs = []
    for on in (False, True):
        _force_pdl(monkeypatch, on)
        outs.append(triton_attention.unified_attention(query, cache[0], meta, d**-0.5, num_splits=num_splits,
                                                       out=torch.empty_like(query)))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not _PDL_CAPABLE, reason="PDL needs compute capability 9.0 or more")
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_engine_tokens_equal_with_pdl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 7, 8, 9, 10] * 40, [3]]
    kwargs = {"dtype": "bfloat16", "max_model_len": 512, "device": "cuda", "enforce_eager": mode == "eager",
              "attention_backend": "triton"}
    # bf16 on CUDA routes the GEMV's shapes to it (tuned, or untuned at 1-2 tokens); make every linear route, with
    # default_config up to 4 tokens
    monkeypatch.setattr(gemv, "serves", lambda _n, _k: True)
    monkeypatch.setattr(gemv, "config_for", lambda m, n, k, device=None: gemv.default_config(n, k, torch.device("cuda"))
                        if m <= 4 else None)
    tokens = greedy_tokens_off_and_on(monkeypatch, pdl, "ENABLED", model_dir, prompts, 24, **kwargs)
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.skipif(not _PDL_CAPABLE, reason="PDL needs compute capability 9.0 or more")
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_engine_tokens_equal_with_late_trigger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Every kernel triggering early (LATE_FROM 0) and late (1) give the same greedy tokens, with the tensor-core GEMV
    forced at 1-8 tokens: the gate-up kernel with its activation, and o / down handing their split-K partials to the
    add + norm, all take PDL (the kernels test_engine_tokens_equal_with_pdl's row loop leaves out)."""
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 7, 8, 9, 10] * 40, [3], [9, 8, 7], [42] * 20, [11, 12]]
    kwargs = {"dtype": "bfloat16", "max_model_len": 512, "device": "cuda", "enforce_eager": mode == "eager",
              "attention_backend": "triton"}
    monkeypatch.setattr(gemv, "serves", lambda _n, _k: True)
    # one K split where N > K (gate-up, which the fused activation needs whole), two elsewhere (o, down: partials)
    monkeypatch.setattr(gemv, "config_for", lambda m, n, k, device=None: GemvConfig(
        32, 64, 1 if n > k else 2, max_m=8, use_dot=True, swap_ab=True) if m <= 8 else None)
    from graphrunner import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = []
    for late_from in (0, 1):
        monkeypatch.setattr(pdl, "LATE_FROM", late_from)
        llm = LLM(model=model_dir, **kwargs)
        tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        del llm
    assert tokens[0] == tokens[1]
