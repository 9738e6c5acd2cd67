"""ModelState for Qwen3ForCausalLM (per-head q/k norms; sliding windows from layer_types)."""

from __future__ import annotations

from torch import nn

from graphrunner.models.qwen3 import Qwen3ForCausalLM
from model_states.base import ModelState


class Qwen3ModelState(ModelState):
    def model_class(self) -> type[nn.Module]:
        return Qwen3ForCausalLM
