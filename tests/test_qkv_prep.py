"""The fused attention prologue (graphrunner/models/qkv_prep.py) against its PyTorch reference: q/k per-head
RMSNorm, rope and the paged-cache write of k and v, on awkward sizes (odd head counts, a head dim whose half is not
a power of two, 0/1/7 tokens, padding slots), three dtypes, norms on and off; bad input; and an engine whose
models take this path (GRAPHRUNNER_FUSED_QKV_PREP) giving the unfused engine's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_tiny_model

from graphrunner.models import qkv_prep
from graphrunner.models.qkv_prep import qkv_prep_ref, qkv_prep_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: only the rope's rounding order differs (one rounding in the kernel, one per op in PyTorch); half
# precision: an ulp or two of the output (bf16 2^-8 relative) where rope's products are rounded separately.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _case(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    block_size, blocks = 4, 6
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype).to(DEVICE)
    angles = torch.rand(t, 1, d // 2, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    weights = [(torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE) for _ in range(2)] if norm else [None, None]
    cache = torch.randn(2, blocks, block_size, hkv, d, generator=g).to(dtype).to(DEVICE)  # stale contents
    # block 0 is the pool's reserved null block (write_kv_ref parks padding writes there): no token lives in it
    slots = (torch.randperm((blocks - 1) * block_size, generator=g)[:t] + block_size).to(DEVICE)
    if t > 2:
        slots[1] = -1  # a padding token: its k/v are never written
    return qkv, cos, sin, weights[0], weights[1], cache, slots


@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(0, 4, 2, 16), (1, 1, 1, 2), (7, 6, 3, 20), (5, 4, 2, 32),
                                                   (3, 3, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
def test_triton_matches_reference(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool) -> None:
    qkv, cos, sin, qn, kn, cache, slots = _case(t, hq, hkv, d, dtype, norm, seed=t * 100 + d)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    q_ref = qkv_prep_ref(qkv, cos, sin, qn, kn, 1e-6, ref_cache, slots, hq, hkv, d)
    q_tri = qkv_prep_triton(qkv, cos, sin, qn, kn, 1e-6, tri_cache, slots, hq, hkv, d)
    assert q_tri.shape == (t, hq * d) and q_tri.dtype == dtype
    torch.testing.assert_close(q_tri, q_ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    torch.testing.assert_close(tri_cache, ref_cache, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    if t > 2:  # the padding token's slot keeps its stale contents in both
        untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool)
        untouched[slots[slots >= 0].cpu()] = False
        flat = cache.view(2, -1, hkv, d)
        assert torch.equal(tri_cache.view(2, -1, hkv, d)[:, untouched.to(DEVICE)], flat[:, untouched.to(DEVICE)])
    v_rows = qkv[:, (hq + hkv) * d:].view(t, hkv, d)  # v goes in unchanged, bit for bit
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(tri_cache[1].view(-1, hkv, d)[s], v_rows[i])


def test_reference_is_the_unfused_models_math() -> None:
    """The reference is exactly RMSNorm + apply_rotary + write_kv_ref as the models run them unfused."""
    from graphrunner.attention.reference import write_kv_ref
    from graphrunner.models.norm import rms_norm
    from graphrunner.models.rotary import apply_rotary

    qkv, cos, sin, qn, kn, cache, slots = _case(5, 4, 2, 16, torch.bfloat16, True, seed=3)
    mine = cache.clone()
    q = qkv_prep_ref(qkv, cos, sin, qn, kn, 1e-5, mine, slots, 4, 2, 16)
    qq, kk, vv = qkv.split([64, 32, 32], dim=-1)
    expected_q = apply_rotary(rms_norm(qq.unflatten(-1, (4, 16)), qn, 1e-5), cos, sin).reshape(5, 64)
    write_kv_ref(apply_rotary(rms_norm(kk.unflatten(-1, (2, 16)), kn, 1e-5), cos, sin), vv.reshape(5, 2, 16),
                 cache, slots)
    assert torch.equal(q, expected_q) and torch.equal(mine, cache)


def test_bad_input_raises_value_error() -> None:
    qkv, cos, sin, qn, kn, cache, slots = _case(3, 4, 2, 16, torch.float32, True, seed=1)
    with pytest.raises(ValueError, match="does not hold"):
        qkv_prep_triton(qkv[:, :-1], cos, sin, qn, kn, 1e-6, cache, slots, 4, 2, 16)
    with pytest.raises(ValueError, match="both or neither"):
        qkv_prep_triton(qkv, cos, sin, qn, None, 1e-6, cache, slots, 4, 2, 16)
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_prep_triton(qkv, cos[:, :, :4], sin[:, :, :4], qn, kn, 1e-6, cache, slots, 4, 2, 16)
    with pytest.raises(ValueError, match="KV heads"):
        qkv_prep_triton(qkv, cos, sin, qn, kn, 1e-6, cache[:, :, :, :1], slots, 4, 2, 16)
    with pytest.raises(ValueError, match="layer_cache must be"):
        qkv_prep_triton(qkv, cos, sin, qn, kn, 1e-6, cache.half(), slots, 4, 2, 16)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_engine_with_fused_prep_gives_unfused_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                                     backend: str) -> None:
    from graphrunner import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path, arch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 7, 8, 9, 10] * 4, [3]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kwargs = {"max_model_len": 64, "attention_backend": backend, "block_size": 4, "max_num_batched_tokens": 16}
    if backend == "triton" and torch.cuda.is_available():
        kwargs["device"] = "cuda"  # compiled Triton: the interpreter is off where CUDA is present
    monkeypatch.setattr(qkv_prep, "FUSED_QKV_PREP", False)
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    calls = [0]

    def counting(prep: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*args: object) -> torch.Tensor:
            calls[0] += 1
            return prep(*args)
        return wrapper

    # the op's body looks its prologue up at call time; the op itself stays as registered (Dynamo traces it)
    monkeypatch.setattr(qkv_prep, "qkv_prep_ref", counting(qkv_prep.qkv_prep_ref))
    monkeypatch.setattr(qkv_prep, "qkv_prep_triton", counting(qkv_prep.qkv_prep_triton))
    monkeypatch.setattr(qkv_prep, "FUSED_QKV_PREP", True)
    monkeypatch.setattr(qkv_prep, "KERNEL_UNDER_INTERPRETER", True)
    got = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    assert calls[0] > 0 and got == expected


def test_engines_under_the_interpreter_take_the_reference_prologue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA the engine's triton backend runs the prologue's PyTorch reference (the kernel, one interpreted
    program per token and head, doubled CPU test time) unless a test asks for the kernel."""
    ctx = SimpleNamespace(backend="triton", kv_cache=[torch.zeros(2, 3, 4, 1, 4)],
                          meta=SimpleNamespace(slot_mapping=torch.tensor([5])))

    used = []
    monkeypatch.setattr(qkv_prep, "INTERPRETED", True)
    monkeypatch.setattr(qkv_prep, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(qkv_prep, "attend", lambda *args: None)
    monkeypatch.setattr(qkv_prep, "qkv_prep_ref", lambda *a: used.append("ref") or torch.zeros(1, 4))
    monkeypatch.setattr(qkv_prep, "qkv_prep_triton", lambda *a: used.append("kernel") or torch.zeros(1, 4))
    args = (torch.zeros(1, 12), torch.ones(1, 1, 2), torch.zeros(1, 1, 2), None, None, 0.0, torch.zeros(1, 4), 0, 1,
            1, 4, 0.5, -1)
    qkv_prep.paged_attention_qkv(*args)
    monkeypatch.setattr(qkv_prep, "KERNEL_UNDER_INTERPRETER", True)
    qkv_prep.paged_attention_qkv(*args)
    monkeypatch.setattr(qkv_prep, "INTERPRETED", False)
    monkeypatch.setattr(qkv_prep, "KERNEL_UNDER_INTERPRETER", False)
    qkv_prep.paged_attention_qkv(*args)
    assert used == ["ref", "kernel", "kernel"]
