"""ModelState for Qwen2ForCausalLM (q/k/v biases; sliding windows from layer_types/max_window_layers)."""

from __future__ import annotations

from torch import nn

from graphrunner.models.qwen2 import Qwen2ForCausalLM
from model_states.base import ModelState


class Qwen2ModelState(ModelState):
    def model_class(self) -> type[nn.Module]:
        return Qwen2ForCausalLM
