"""ModelState for Qwen3ForCausalLM: per-head q/k norms (in the model), Qwen2's sliding-window rules."""

from __future__ import annotations

from torch import nn

from graphrunner.models.qwen3 import Qwen3ForCausalLM
from model_states.qwen2 import Qwen2ModelState


class Qwen3ModelState(Qwen2ModelState):
    def model_class(self) -> type[nn.Module]:
        return Qwen3ForCausalLM
