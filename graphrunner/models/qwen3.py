"""Qwen3ForCausalLM: the shared decoder with per-head q/k RMSNorm; attention_bias from the config."""

from __future__ import annotations

from collections.abc import Sequence

from graphrunner.config import ModelConfig
from graphrunner.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """q_norm/k_norm on each head before rope; q/k/v/o biases iff config.attention_bias."""

    def __init__(self, config: ModelConfig, *, scale: float | None = None,
                 sliding_windows: Sequence[int | None] | None = None) -> None:
        super().__init__(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True,
                         scale=scale, sliding_windows=sliding_windows)
