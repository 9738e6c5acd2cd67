"""The shared Llama-style decoder: pre-norm layers, the stack (`model.*`) and the causal-LM head.

Architecture files (qwen3.py, llama.py, qwen2.py) subclass `DecoderForCausalLM` and only choose
biases and q/k norms. Interface: `model(input_ids [T], positions [T]) -> hidden [T, H]` under a
forward context, and `compute_logits(hidden [N, H]) -> [N, vocab] float32`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from graphrunner.config import ModelConfig
from graphrunner.models import norm as norm_mod
from graphrunner.models.linear import linear
from graphrunner.models.mlp import GatedMLP
from graphrunner.models.norm import RMSNorm
from graphrunner.models.parallel_linear import ParallelLMHead, VocabParallelEmbedding, parallel_logits
from graphrunner.models.rotary import RotaryEmbedding
from graphrunner.models.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    """hidden = hidden + attn(norm(hidden)); hidden = hidden + mlp(norm(hidden)), as in HF."""

    def __init__(self, config: ModelConfig, layer_idx: int, scale: float, sliding_window: int | None, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, layer_idx, scale,
            qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, norm_eps=config.rms_norm_eps,
            sliding_window=sliding_window,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]."""
        norm = self.input_layernorm
        if isinstance(norm, RMSNorm):  # the norms travel with their projections (norm_linear may fuse them)
            hidden = hidden + self.self_attn(hidden, cos, sin, norm=norm)
        else:  # an EAGLE head's first layer has no input norm (nn.Identity)
            hidden = hidden + self.self_attn(norm(hidden), cos, sin)
        return hidden + self.mlp(hidden, norm=self.post_attention_layernorm)

    def forward_fused(self, residual: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with each residual add and the norm after it in one op (graphrunner::add_rms_norm, or
        with the projection before it: models.linear_add_norm). Takes the hidden state (`residual` [T, H]) and its
        input norm (`normed`); returns the hidden state after the layer and `next_norm` of it (the next layer's
        input norm, or the final norm)."""
        attn = self.self_attn.attend(normed, cos, sin)  # [T, Hq*D], o_proj still to apply
        normed, residual = self.self_attn.o_proj.forward_add_norm(attn, residual, self.post_attention_layernorm)
        normed, residual = self.mlp.forward_add_norm(normed, residual, next_norm)
        return residual, normed


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm; rope cos/sin are looked up once and shared by all layers."""

    def __init__(self, config: ModelConfig, scale: float, sliding_windows: Sequence[int | None], *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool) -> None:
        super().__init__()
        if len(sliding_windows) != config.num_layers:
            raise ValueError(f"got {len(sliding_windows)} sliding windows for {config.num_layers} layers")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, scale, sliding_windows[i], qkv_bias=qkv_bias, o_bias=o_bias,
                         qk_norm=qk_norm, mlp_bias=mlp_bias)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 (or inputs_embeds [T, H]) -> hidden [T, H]."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, H]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # each [T, 1, D/2]
        if norm_mod.FUSED_ADD_NORM and self.layers:
            normed = self.layers[0].input_layernorm(hidden)
            next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            for layer, next_norm in zip(self.layers, next_norms, strict=True):
                hidden, normed = layer.forward_fused(hidden, normed, cos, sin, next_norm)
            return normed
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)


class DecoderForCausalLM(nn.Module):
    """`model` (the stack) + `lm_head`; with tied embeddings there is no lm_head parameter at all."""

    # Fused parameter -> the HF projections stacked in it, in order (used by graphrunner.loader).
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool, qk_norm: bool, mlp_bias: bool = False,
                 scale: float | None = None, sliding_windows: Sequence[int | None] | None = None) -> None:
        super().__init__()
        self.config = config
        if scale is None:
            scale = config.head_dim ** -0.5
        if sliding_windows is None:
            sliding_windows = [config.sliding_window] * config.num_layers
        self.model = DecoderModel(config, scale, sliding_windows, qkv_bias=qkv_bias, o_bias=o_bias,
                                  qk_norm=qk_norm, mlp_bias=mlp_bias)
        self.lm_head: ParallelLMHead | None = (
            None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size)
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, H]; for callers that build inputs_embeds themselves."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H] (final norm applied)."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] float32 (with tensor parallelism: the full vocabulary on every rank)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V / ranks, H]
        return parallel_logits(hidden, weight, self.config.vocab_size)

    def compute_logits_shard(self, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """hidden [N, H] -> (this rank's logits [N, ceil(V / ranks)] in the model dtype, the first id they cover);
        ids past the vocabulary are padding. For sampling without gathering the logits."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head.weight), head.vocab_start
