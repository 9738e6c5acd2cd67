"""Loader and ModelState tests: sharded and tied checkpoints, strict name checks (missing, unexpected,
no weights, unsupported architecture), bf16 loading, and the ModelState capture defaults.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, model_state_for

from graphrunner.config import ModelConfig
from graphrunner.input_prep import StepBuffers
from graphrunner.loader import checkpoint_files, load_model
from model_states import get_model_state, supported_architectures
from model_states.base import ModelState

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM")


def _load(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(model_dir, model_state_for(model_dir), dtype, CPU)


def _rewrite_checkpoint(src: Path, dst: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None
                        ) -> Path:
    """Copy a single-file tiny model to dst with some tensors dropped or added."""
    shutil.copytree(src, dst)
    tensors = {k: v for k, v in load_file(dst / "model.safetensors").items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _all_checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_dir):
        out.update(load_file(f))
    return out


def test_sharded_checkpoint_loads_into_fused_slices(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen2ForCausalLM", max_shard_size="50KB")
    assert (model_dir / "model.safetensors.index.json").is_file() and len(checkpoint_files(model_dir)) > 1
    model = _load(model_dir)
    ckpt = _all_checkpoint_tensors(model_dir)
    attn = model.model.layers[1].self_attn
    prefix = "model.layers.1.self_attn."
    for part in ("weight", "bias"):
        expected = torch.cat([ckpt[f"{prefix}{p}.{part}"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(getattr(attn.qkv_proj, part), expected)
    mlp = model.model.layers[1].mlp
    expected = torch.cat([ckpt["model.layers.1.mlp.gate_proj.weight"], ckpt["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, expected)
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_tied_embeddings_and_ignored_keys(qwen3_dir: Path, tmp_path: Path) -> None:
    model = _load(qwen3_dir)
    assert model.lm_head is None and "lm_head.weight" not in dict(model.named_parameters())
    ckpt = load_file(qwen3_dir / "model.safetensors")
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ ckpt["model.embed_tokens.weight"].T)
    # A tied checkpoint that still stores lm_head.weight, and rotary inv_freq buffers, load fine.
    extra = {"lm_head.weight": ckpt["model.embed_tokens.weight"].clone(),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    _load(_rewrite_checkpoint(qwen3_dir, tmp_path / "extra", add=extra))


def test_missing_weights_are_named(qwen3_dir: Path, tmp_path: Path) -> None:
    drop = ("model.layers.0.self_attn.v_proj.weight", "model.norm.weight", "model.layers.2.mlp.up_proj.weight")
    bad = _rewrite_checkpoint(qwen3_dir, tmp_path / "missing", drop=drop)
    with pytest.raises(ValueError, match="missing") as err:
        _load(bad)
    for name in drop:
        assert name in str(err.value)
    assert "k_proj" not in str(err.value)


def test_unexpected_weights_are_named(qwen3_dir: Path, tmp_path: Path) -> None:
    add = {"model.layers.0.self_attn.extra_proj.weight": torch.zeros(2, 2), "model.layers.9.mlp.up_proj.weight":
           torch.zeros(2, 2)}
    bad = _rewrite_checkpoint(qwen3_dir, tmp_path / "unexpected", add=add)
    with pytest.raises(ValueError, match="unexpected") as err:
        _load(bad)
    for name in add:
        assert name in str(err.value)


def test_wrong_shape_is_named(qwen3_dir: Path, tmp_path: Path) -> None:
    bad = _rewrite_checkpoint(qwen3_dir, tmp_path / "shape", add={"model.norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(7,\)"):
        _load(bad)


def test_no_weights_names_directory(qwen3_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(qwen3_dir / "config.json", empty / "config.json")
    with pytest.raises(ValueError, match="no safetensors") as err:
        _load(empty)
    assert str(empty) in str(err.value)


def test_unsupported_architecture(qwen3_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(qwen3_dir, other)
    hf = json.loads((other / "config.json").read_text())
    hf["architectures"] = ["FooForCausalLM"]
    (other / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="unsupported architecture 'FooForCausalLM'") as err:
        _load(other)
    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"):
        assert arch in str(err.value)
    assert set(supported_architectures()) >= {"Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"}


def test_bf16_loads_as_bf16(qwen3_dir: Path) -> None:
    model = _load(qwen3_dir, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ckpt = load_file(qwen3_dir / "model.safetensors")
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"].to(torch.bfloat16))
    assert model.model.rotary_emb.cos_cache.dtype == torch.float32  # rope tables stay fp32, cast per use


def test_model_state_defaults(qwen3_dir: Path) -> None:
    cfg = ModelConfig.from_dir(qwen3_dir)
    state = get_model_state(cfg.architecture)(cfg)
    assert isinstance(state, ModelState)
    assert state.attention_scale == cfg.head_dim ** -0.5
    assert [state.sliding_window(i) for i in range(cfg.num_layers)] == [None] * cfg.num_layers
    assert state.decode_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176,
                                             192, 208, 224, 240, 256]
    assert state.decode_batch_sizes(512)[-9:] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert state.decode_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert state.decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert state.decode_batch_sizes(1) == [1]
    buckets = state.token_buckets(3000)  # capped at MAX_TOKEN_BUCKET (2048): larger steps run without graphs
    assert buckets == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048]
    assert state.token_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]
    assert state.token_buckets(700)[-3:] == [256, 512, 700]
    buffers = StepBuffers(4, 8, 3, CPU)
    buffers.slot_mapping.fill_(7)  # stale values of an earlier step: the dummy inputs must write no KV
    inputs, shape = state.dummy_inputs(buffers, 5)
    assert inputs.input_ids.dtype == torch.int64 and inputs.positions.tolist() == [0, 1, 2, 3, 4]
    assert inputs.slot_mapping.tolist() == [-1] * 5 and (shape.num_reqs, shape.num_tokens) == (0, 5)
    inputs, shape = state.dummy_inputs(buffers, 5, prefill=True)  # the profiling shape: one request
    assert inputs.query_start_loc.tolist() == [0, 5] and inputs.seq_lens.tolist() == [5]
    assert shape.query_lens == shape.seq_lens == (5,) and inputs.slot_mapping.tolist() == [-1] * 5


def test_sliding_window_follows_layer_types(qwen3_dir: Path) -> None:
    hf = json.loads((qwen3_dir / "config.json").read_text())
    hf.update(use_sliding_window=True, sliding_window=32, layer_types=None, max_window_layers=1)
    cfg = ModelConfig.from_hf(hf)
    state = get_model_state(cfg.architecture)(cfg, hf)
    assert [state.sliding_window(i) for i in range(3)] == [None, 32, 32]
    hf["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    state = get_model_state(cfg.architecture)(cfg, hf)
    model = state.build_model(torch.float32, CPU)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [32, None, 32]
