"""MistralForCausalLM: the shared decoder as Llama builds it, without biases; its one difference from
Llama, a sliding window on every layer, is declared by model_states/mistral.py."""

from __future__ import annotations

from collections.abc import Sequence

from graphrunner.config import ModelConfig
from graphrunner.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig, *, scale: float | None = None,
                 sliding_windows: Sequence[int | None] | None = None) -> None:
        super().__init__(config, qkv_bias=False, o_bias=False, qk_norm=False, scale=scale,
                         sliding_windows=sliding_windows)
