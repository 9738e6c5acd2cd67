"""Tiny EAGLE-1 heads saved in vLLM's checkpoint layout (`fc.*`, `layers.0.*`, config.json with architectures
"EagleLlamaForCausalLM"), plus an "attention-free" tiny target for which a head can be exact. A helper module for
tests, not a test file: `from tiny_eagle import make_eagle_head, make_attention_free_pair`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tiny_models import make_tiny_model


def _layer_weights(model: Any) -> dict[str, torch.Tensor]:
    """Layer 0 of an HF causal LM as `layers.0.*`, without its input norm (an EAGLE head's layer 0 has none)."""
    return {name[len("model."):]: p.detach().clone().contiguous() for name, p in model.state_dict().items()
            if name.startswith("model.layers.0.") and "input_layernorm" not in name}


def _save_head(out: Path, config: Any, weights: dict[str, torch.Tensor], architecture: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    cfg = config.to_dict()
    cfg.update(num_hidden_layers=1, architectures=[architecture])
    cfg.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out


def make_eagle_head(tmp_dir: Path, target_dir: Path, seed: int = 0, *, fc_bias: bool = False,
                    hidden_size: int | None = None, architecture: str = "EagleLlamaForCausalLM",
                    with_embedding: bool = True) -> Path:
    """A random-weight one-layer head for `target_dir` (same layer kind and sizes unless `hidden_size` overrides),
    saved with save_file; `with_embedding` also stores an `embed_tokens.weight` copy (EAGLE checkpoints carry one,
    which the target's replaces)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:1]
    if hidden_size is not None:
        config.hidden_size = hidden_size
    torch.manual_seed(1000 + seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    h = config.hidden_size
    weights = _layer_weights(model)
    with torch.no_grad():
        for name, w in weights.items():
            if name.endswith("norm.weight"):
                w.uniform_(0.5, 1.5)
    weights["fc.weight"] = torch.randn(h, 2 * h) * (0.5 / h ** 0.5)
    if fc_bias:
        weights["fc.bias"] = torch.randn(h) * 0.1
    if with_embedding:
        weights["embed_tokens.weight"] = torch.randn(config.vocab_size, h)  # ignored: the target's is used
    return _save_head(Path(tmp_dir) / f"eagle-{seed}-{h}-{int(fc_bias)}", config, weights, architecture)


def make_attention_free_pair(tmp_dir: Path) -> tuple[Path, Path]:
    """(target, head): a one-layer Llama whose attention output is zero (o_proj = 0) and final norm weight is 1, so
    its greedy choice at position p is a function of token p alone; and a head that is exact for it: fc picks the
    token embedding, its layer is the target's layer. The head's output at p (fed the token at p + 1) is then the
    target's final hidden state at p + 1 up to a positive scale, so every greedy draft must be accepted."""
    from transformers import AutoModelForCausalLM

    base = make_tiny_model(Path(tmp_dir), "LlamaForCausalLM", seed=3, num_hidden_layers=1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    target = Path(tmp_dir) / "attention-free-target"
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).is_file():
            (target / name).write_bytes((base / name).read_bytes())
    h = model.config.hidden_size
    weights = _layer_weights(model)
    weights["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)  # [H, 2H]: the embedding half
    head = _save_head(Path(tmp_dir) / "attention-free-head", model.config, weights, "EagleLlamaForCausalLM")
    return target, head
