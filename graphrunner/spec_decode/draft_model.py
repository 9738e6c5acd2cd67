"""The draft-model proposer (vLLM's method="draft_model"): a smaller model with the same vocabulary, its
own ModelState and KV cache, indexed by the target's block table and slots (same block ids, its own tensor).

Every step the draft model runs over the target's own step inputs (so its KV matches the target's positions,
prefill chunks included; rejected drafts' positions are rewritten by the next step, like the target's). After the
post-update it drafts greedily: k single-token forwards from each row's last token, each draft written into the
row's history tail. The scheduler reserves k positions of KV blocks ahead for these writes. Nothing here syncs
with the host, so a FULL verify graph records these forwards too (on a GPU the worker compiles the draft model
with plain Inductor: capture.compiled.compile_draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.attention import forward_context
from graphrunner.input_prep import StepInputs
from graphrunner.spec_config import SpeculativeConfig
from graphrunner.spec_decode.draft_steps import DraftSteps, greedy_drafts
from graphrunner.state_table import StateTable
from graphrunner.step_plan import StepShape
from model_states.base import ModelState


@dataclass
class DraftModel:
    model: nn.Module
    model_state: ModelState
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, Hkv, D], the target's block ids


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel, state: StateTable, use_triton: bool,
                 attention_backend: str) -> None:
        self.config = config
        self.draft = draft
        self.state = state
        self.use_triton = use_triton
        self.attention_backend = attention_backend

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def _forward(self, inputs: StepInputs, shape: StepShape) -> torch.Tensor:
        d = self.draft
        meta = d.model_state.prepare_attn(inputs, shape)
        with forward_context(meta, d.kv_cache, self.attention_backend):
            return d.model_state.forward(d.model, inputs.input_ids, inputs.positions).hidden

    def observe(self, inputs: StepInputs, shape: StepShape) -> None:
        """The draft model over the target's step inputs: writes its KV at the same positions."""
        self._forward(inputs, shape)

    def propose(self, idx_mapping: torch.Tensor, seq_lens_upper: tuple[int, ...]) -> None:
        """After the post-update: k greedy draft tokens per row from its last token (position num_computed).
        seq_lens_upper: host upper bounds of each row's num_computed (the step's StepShape.seq_lens)."""
        if idx_mapping.shape[0] == 0:
            return
        k = self.config.num_speculative_tokens
        steps = DraftSteps(idx_mapping, self.state, self.draft.model_state.block_size, self.use_triton,
                           seq_lens_upper)
        for i in range(k):
            hidden = self._forward(*steps.inputs(i))  # [B, hidden]
            steps.write(i, greedy_drafts(self.draft.model, hidden, self.use_triton), next_step=i + 1)
