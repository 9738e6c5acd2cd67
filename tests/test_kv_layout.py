"""The KV cache's memory order (GRAPHRUNNER_KV_LAYOUT, kv_cache.KV_LAYOUT): "hnd" storage behind the same logical
[layers, 2, blocks, block_size, Hkv, D] view gives every reader and writer the same values as the default "nhd":
the Triton attention kernel (decode rows, a chunk over a cached prefix, splits), its KV write and the q/k prologue
bit-equal across layouts and against the PyTorch reference, the reference write through a strided view, and an
engine's greedy tokens (CPU; on a GPU through FULL graphs and eager). A bad value is refused by name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import QKV_PREP_HEADS, make_tiny_model, qkv_prep_case

from graphrunner import kv_cache
from graphrunner.attention import triton_attention
from graphrunner.attention.reference import paged_attention_ref, write_kv_ref
from graphrunner.attention.testing import contiguous_batch
from graphrunner.config import ModelConfig
from graphrunner.models import qkv_prep

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _as_hnd(cache: torch.Tensor) -> torch.Tensor:
    """The same values as cache [..., blocks, block_size, Hkv, D], in [..., blocks, Hkv, block_size, D] storage."""
    return cache.transpose(-3, -2).contiguous().transpose(-3, -2)


def test_hnd_allocation_is_the_logical_shape_over_head_major_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    monkeypatch.setattr(kv_cache, "KV_LAYOUT", "nhd")
    nhd = kv_cache.allocate_kv_cache(model, 5, 4, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(kv_cache, "KV_LAYOUT", "hnd")
    hnd = kv_cache.allocate_kv_cache(model, 5, 4, torch.float32, torch.device("cpu"))
    assert hnd.shape == nhd.shape == (3, 2, 5, 4, 2, 8)
    assert nhd.is_contiguous() and not hnd.is_contiguous()
    assert hnd.stride()[3:] == (8, 4 * 8, 1)  # slot, then head (a block_size x D run), then D
    assert torch.count_nonzero(hnd) == 0


@pytest.mark.parametrize(("query_lens", "context_lens", "num_splits", "block_size"), [
    ([1, 1, 1], [37, 1, 200], 1, 16),  # decode rows
    ([1, 1, 1], [37, 1, 200], 3, 16),  # ... split
    ([1, 70], [9, 219], 1, 4),  # a 70-token chunk over 149 cached keys
    ([1, 20], [9, 150], 5, 8),  # a short chunk over a cached prefix, split like a decode
])
def test_attention_is_bit_equal_across_layouts(query_lens: list[int], context_lens: list[int], num_splits: int,
                                               block_size: int) -> None:
    hq, hkv, d = 6, 3, 24
    meta, caches = contiguous_batch(query_lens, context_lens, 1, hkv, d, block_size, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(sum(context_lens) + num_splits)
    nhd = torch.randn(caches[0].shape, generator=g).to(DEVICE)
    hnd = _as_hnd(nhd)
    query = torch.randn(meta.num_tokens, hq, d, generator=g).to(DEVICE)
    outs = [triton_attention.unified_attention(query, c, meta, d ** -0.5, num_splits=num_splits,
                                               out=torch.empty_like(query)) for c in (nhd, hnd)]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], paged_attention_ref(query, hnd, meta, d ** -0.5), atol=2e-5, rtol=2e-5)


def test_kv_writes_land_in_the_same_slots_across_layouts() -> None:
    t, hkv, d, blocks, bs = 6, 3, 20, 5, 4
    g = torch.Generator().manual_seed(11)
    key, value = (torch.randn(t, hkv, d, generator=g).to(DEVICE) for _ in range(2))
    slots = torch.tensor([5, -1, 9, 17, 2, 19], device=DEVICE)
    results = []
    for write in (write_kv_ref, triton_attention.write_kv_triton):
        for layout in ("nhd", "hnd"):
            cache = torch.zeros(2, blocks, bs, hkv, d, device=DEVICE)
            cache = _as_hnd(cache) if layout == "hnd" else cache
            write(key, value, cache, slots)
            results.append(cache.contiguous())
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert torch.equal(results[0][0].view(-1, hkv, d)[9], key[2]) and results[0][1].view(-1, hkv, d)[19].equal(value[5])


def test_qkv_prologue_writes_the_same_cache_across_layouts() -> None:
    hq, hkv, d = QKV_PREP_HEADS
    qkv, cos, sin, qn, kn, slots = qkv_prep_case(DEVICE)
    results = []
    for prep in (qkv_prep.qkv_prep_ref, qkv_prep.qkv_prep_triton):
        for layout in ("nhd", "hnd"):
            cache = torch.zeros(2, 7, 4, hkv, d, device=DEVICE)
            cache = _as_hnd(cache) if layout == "hnd" else cache
            q = prep(qkv, cos, sin, qn, kn, 1e-6, cache, slots, hq, hkv, d)
            results.append((q, cache.contiguous()))
    for q, cache in results[1:]:
        torch.testing.assert_close(q, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache, results[0][1], atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[2][1], results[3][1])


def _greedy_by_layout(monkeypatch: pytest.MonkeyPatch, model_dir: Path, **kwargs: object) -> list[list[list[int]]]:
    from graphrunner import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 11] * 6, [5, 6, 7, 8, 9, 10, 11] * 6 + [3, 4], [3] * 50]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = []
    for layout in ("nhd", "hnd"):
        monkeypatch.setattr(kv_cache, "KV_LAYOUT", layout)
        llm = LLM(model=model_dir, **kwargs)
        tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        del llm
    return tokens


def test_engine_tokens_equal_across_layouts_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the second prompt shares the first's blocks: a prefix-cache hit reads KV written under the same layout
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    tokens = _greedy_by_layout(monkeypatch, model_dir, max_model_len=256, block_size=8, enforce_eager=True)
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_gpu_engine_tokens_equal_across_layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    tokens = _greedy_by_layout(monkeypatch, model_dir, dtype="bfloat16", max_model_len=512, device="cuda",
                               enforce_eager=mode == "eager", attention_backend="triton")
    assert tokens[0] == tokens[1]


def test_a_bad_layout_is_refused_by_name() -> None:
    env = {"GRAPHRUNNER_KV_LAYOUT": "nchw", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", "import graphrunner.kv_cache"], capture_output=True, text=True,
                          check=False, env=env, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode != 0 and "GRAPHRUNNER_KV_LAYOUT" in done.stderr
