"""ModelState for LlamaForCausalLM; reads `mlp_bias` (not a ModelConfig field) from the raw HF config."""

from __future__ import annotations

from typing import Any

from torch import nn

from graphrunner.models.llama import LlamaForCausalLM
from model_states.base import ModelState


class LlamaModelState(ModelState):
    def model_class(self) -> type[nn.Module]:
        return LlamaForCausalLM

    def model_kwargs(self) -> dict[str, Any]:
        return {**super().model_kwargs(), "mlp_bias": bool(self.hf_config.get("mlp_bias", False))}
