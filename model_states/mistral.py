"""ModelState for MistralForCausalLM: Llama's layers with a sliding window on every layer
(`sliding_window` in config.json; null means full attention)."""

from __future__ import annotations

from torch import nn

from graphrunner.models.mistral import MistralForCausalLM
from model_states.base import ModelState


class MistralModelState(ModelState):
    def model_class(self) -> type[nn.Module]:
        return MistralForCausalLM

    def sliding_window(self, layer_idx: int) -> int | None:
        return self.config.sliding_window
