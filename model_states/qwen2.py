"""ModelState for Qwen2ForCausalLM: q/k/v biases, and sliding windows on the layers that HF's
`layer_types` (or, in older configs, `max_window_layers`) marks, when `use_sliding_window` is set."""

from __future__ import annotations

from torch import nn

from graphrunner.models.qwen2 import Qwen2ForCausalLM
from model_states.base import ModelState


class Qwen2ModelState(ModelState):
    def model_class(self) -> type[nn.Module]:
        return Qwen2ForCausalLM

    def sliding_window(self, layer_idx: int) -> int | None:
        window = self.config.sliding_window  # None unless use_sliding_window (ModelConfig.from_hf)
        if window is None:
            return None
        layer_types = self.hf_config.get("layer_types")
        if layer_types:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        max_window_layers = self.hf_config.get("max_window_layers")
        if max_window_layers is not None:
            return window if layer_idx >= max_window_layers else None
        return window
