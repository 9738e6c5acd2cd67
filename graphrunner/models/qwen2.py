"""Qwen2ForCausalLM: the shared decoder with q/k/v biases always on and no o_proj bias."""

from __future__ import annotations

from collections.abc import Sequence

from graphrunner.config import ModelConfig
from graphrunner.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 ignores config.attention_bias: q/k/v always carry a bias, o_proj never does."""

    def __init__(self, config: ModelConfig, *, scale: float | None = None,
                 sliding_windows: Sequence[int | None] | None = None) -> None:
        super().__init__(config, qkv_bias=True, o_bias=False, qk_norm=False, scale=scale,
                         sliding_windows=sliding_windows)
