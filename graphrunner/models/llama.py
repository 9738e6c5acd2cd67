"""LlamaForCausalLM: the shared decoder; attention_bias (q/k/v/o) and mlp_bias from the HF config.

`mlp_bias` is not a ModelConfig field: the ModelState reads it from the raw HF config and passes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from graphrunner.config import ModelConfig
from graphrunner.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain pre-norm Llama; rope 'default' or 'llama3' comes from config.rope."""

    def __init__(self, config: ModelConfig, *, mlp_bias: bool = False, scale: float | None = None,
                 sliding_windows: Sequence[int | None] | None = None) -> None:
        super().__init__(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=False,
                         mlp_bias=mlp_bias, scale=scale, sliding_windows=sliding_windows)
