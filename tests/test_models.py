"""Our models against Hugging Face in fp32 on CPU: batched prefill logits, and decode / chunked-prefill
steps over a cached prefix, for Qwen3, Llama (default and llama3 rope, with biases) and Qwen2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import hf_logits, llama3_rope_overrides, make_tiny_model, model_state_for

from graphrunner.attention import forward_context
from graphrunner.attention.testing import contiguous_batch
from graphrunner.config import ModelConfig, RopeConfig
from graphrunner.loader import load_model
from graphrunner.models.rotary import rope_inv_freq

BLOCK_SIZE = 8
ATOL = 1e-4

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    "llama": ("LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaForCausalLM", llama3_rope_overrides()),
    "llama-biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2ForCausalLM", {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    arch, overrides = VARIANTS[request.param]
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    model = load_model(model_dir, model_state_for(model_dir), torch.float32, torch.device("cpu"))
    return model_dir, model


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _step(model: Any, seqs: list[list[int]], query_lens: list[int], context_lens: list[int],
          kv_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the last query_lens[b] of the first context_lens[b] tokens of each sequence as one batch.
    Returns (logits [T, V] float32, block_table, kv_cache)."""
    cfg: ModelConfig = model.config
    meta, fresh = contiguous_batch(query_lens, context_lens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                   BLOCK_SIZE, torch.float32, "cpu")
    kv = fresh if kv_cache is None else kv_cache
    input_ids = torch.tensor([t for s, q, c in zip(seqs, query_lens, context_lens) for t in s[c - q:c]])  # [T]
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])  # [T] int64
    with torch.no_grad(), forward_context(meta, kv):
        hidden = model(input_ids, positions)  # [T, H]
    assert hidden.shape == (sum(query_lens), cfg.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(query_lens), cfg.vocab_size)
    return logits, meta.block_table, kv


def test_batched_prefill_matches_hf(tiny: tuple[Path, Any]) -> None:
    model_dir, model = tiny
    lengths = [5, 17, 1, 30]
    seqs = _prompts(lengths, model.config.vocab_size)
    logits, _, _ = _step(model, seqs, lengths, lengths)
    for ours, seq in zip(logits.split(lengths), seqs):
        torch.testing.assert_close(ours, hf_logits(model_dir, seq), atol=ATOL, rtol=0)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 4]], ids=["decode", "mixed-chunk"])
def test_step_over_cached_prefix_matches_hf(tiny: tuple[Path, Any], query_lens: list[int]) -> None:
    model_dir, model = tiny
    prefix = [5, 13, 17]  # block counts of prefix and prefix + query agree, so both steps share a layout
    context = [p + q for p, q in zip(prefix, query_lens)]
    seqs = _prompts(context, model.config.vocab_size, seed=1)
    _, table_prefill, kv = _step(model, seqs, prefix, prefix)
    logits, table_step, _ = _step(model, seqs, query_lens, context, kv_cache=kv)
    assert torch.equal(table_prefill, table_step)
    for ours, seq, q in zip(logits.split(query_lens), seqs, query_lens):
        torch.testing.assert_close(ours, hf_logits(model_dir, seq)[-q:], atol=ATOL, rtol=0)


def test_llama3_inv_freq_matches_hf() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_scaling=params)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    rope = RopeConfig(theta=500_000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    ours = rope_inv_freq(128, rope)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, rope_inv_freq(128, RopeConfig(theta=500_000.0)))
