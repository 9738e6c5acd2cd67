"""ModelState of an EAGLE-1 draft head: reads the head's directory (config.json, safetensors), checks it against
the target, and says which decoder layer it has. The head's config names a Llama-style architecture
("EagleLlamaForCausalLM", or plain "LlamaForCausalLM" as the EAGLE checkpoints ship); the layer flags per
architecture live here, beside the other architectures' ModelStates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn

from graphrunner.config import ModelConfig
from graphrunner.loader import check_checkpoint, checkpoint_files
from graphrunner.models.eagle import EagleHead, LayerFlags
from model_states.base import ModelState


def _llama_flags(cfg: ModelConfig) -> LayerFlags:
    return LayerFlags(cfg.attention_bias, cfg.attention_bias, False, bool(cfg.hf.get("mlp_bias", False)))


_LAYER_FLAGS = {
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": lambda cfg: LayerFlags(False, False, False, False),
    "Qwen2ForCausalLM": lambda cfg: LayerFlags(True, False, False, False),
    "Qwen3ForCausalLM": lambda cfg: LayerFlags(cfg.attention_bias, cfg.attention_bias, True, False),
}


def head_layer_architecture(architecture: str) -> str:
    """"EagleLlamaForCausalLM" -> "LlamaForCausalLM" (vLLM's names); a plain name stays; ValueError if unknown."""
    base = architecture.removeprefix("Eagle")
    if base not in _LAYER_FLAGS:
        known = sorted(_LAYER_FLAGS) + sorted("Eagle" + a for a in _LAYER_FLAGS)
        raise ValueError(f"EAGLE head architecture {architecture!r} is not supported; known: {known}")
    return base


class EagleModelState(ModelState):
    """The head's attention metadata comes from the base class (its KV cache is indexed by the target's block
    table); `fc_bias`: whether the checkpoint has `fc.bias` (the EAGLE reference trains one, some exports drop it)."""

    def __init__(self, config: ModelConfig, *, block_size: int = 16, fc_bias: bool = False) -> None:
        super().__init__(config, block_size=block_size)
        self.flags = _LAYER_FLAGS[head_layer_architecture(config.architecture)](config)
        self.fc_bias = fc_bias

    @classmethod
    def from_dir(cls, head_dir: str | Path, target: ModelConfig, block_size: int) -> EagleModelState:
        """The head of directory `head_dir` for `target`; ValueError when it is not a head directory or does not
        fit the target (hidden size)."""
        head_dir = Path(head_dir)
        if not (head_dir / "config.json").is_file():
            raise ValueError(f"speculative_config model {str(head_dir)!r} is not an EAGLE head directory "
                             f"(no config.json)")
        cfg = ModelConfig.from_dir(head_dir)
        if cfg.hidden_size != target.hidden_size:
            raise ValueError(f"the EAGLE head's hidden size ({cfg.hidden_size}) differs from the target's "
                             f"({target.hidden_size}); the head must be trained for this target model")
        files = checkpoint_files(head_dir)
        check_checkpoint(files)
        keys: set[str] = set()
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys.update(f.keys())
        if "fc.weight" not in keys:
            raise ValueError(f"{head_dir} is not an EAGLE-1 head checkpoint: no 'fc.weight' tensor")
        return cls(cfg, block_size=block_size, fc_bias="fc.bias" in keys)

    def model_class(self) -> type[nn.Module]:
        return EagleHead

    def model_kwargs(self) -> dict[str, Any]:
        return {**super().model_kwargs(), "flags": self.flags, "fc_bias": self.fc_bias}
