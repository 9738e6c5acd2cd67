"""An EAGLE-1 draft head (vLLM's EagleLlamaForCausalLM checkpoint layout): `fc` Linear(2H -> H) over
concat(embed(token), target hidden), then decoder layers of the target's kind (layer 0 without its input norm, as
the EAGLE reference), no final norm. The embedding and LM head are the target's: the caller embeds and projects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from graphrunner.config import ModelConfig
from graphrunner.models.decoder import DecoderForCausalLM, DecoderLayer
from graphrunner.models.linear import Linear
from graphrunner.models.rotary import RotaryEmbedding


@dataclass(frozen=True)
class LayerFlags:
    """Which biases and norms a decoder layer of one architecture has (its ModelState says)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool


class EagleHead(nn.Module):
    """Parameters named as an EAGLE-1 checkpoint names them (`fc.*`, `layers.N.*`); the checkpoint's copies of
    the shared embedding / LM head, if any, are not loaded (`shared_checkpoint_weights`)."""

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = DecoderForCausalLM.packed_modules
    shared_checkpoint_weights: ClassVar[tuple[str, ...]] = ("embed_tokens.weight", "lm_head.weight")

    def __init__(self, config: ModelConfig, *, flags: LayerFlags, fc_bias: bool, scale: float,
                 sliding_windows: Sequence[int | None]) -> None:
        super().__init__()
        if len(sliding_windows) != config.num_layers:
            raise ValueError(f"got {len(sliding_windows)} sliding windows for {config.num_layers} head layers")
        self.config = config
        h = config.hidden_size
        self.fc = Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, scale, sliding_windows[i], qkv_bias=flags.qkv_bias, o_bias=flags.o_bias,
                         qk_norm=flags.qk_norm, mlp_bias=flags.mlp_bias)
            for i in range(config.num_layers)
        )
        # the reference EAGLE head feeds fc's output straight into layer 0's attention
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_embeds [T, H] (the target's embedding of each position's NEXT token), hidden [T, H] (the target's
        final hidden state at each position, or the head's own output while drafting), positions [T] int64 ->
        the head's hidden [T, H]: the target's LM head turns it into draft logits, and it is the next draft
        step's `hidden`."""
        x = self.fc(torch.cat((input_embeds, hidden.to(input_embeds.dtype)), dim=-1))  # [T, H]
        cos, sin = self.rotary_emb(positions, x.dtype)  # each [T, 1, D/2]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x
