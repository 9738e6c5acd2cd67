"""The EAGLE proposer (vLLM's method="eagle"): a one-layer head drafting from the target's final hidden states, with
its own KV cache indexed by the target's block table and slots (same block ids, its own tensor).

After each step's post-update the head observes the step: at every scheduled position p it reads the target's
hidden state at p and the token now known at p + 1 (an accepted draft, the bonus token, the next prompt token),
writing its KV at p. Its output at each row's last accepted position (num_computed - 1) gives the first draft; k - 1
single-token head steps give the rest, each written into the row's history tail. Positions past the accepted ones
get garbage KV, rewritten by the next step's observation (as the target's rejected drafts are). Nothing here syncs
with the host, so a FULL verify graph records all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.attention import forward_context
from graphrunner.input_prep import StepInputs
from graphrunner.spec_config import SpeculativeConfig
from graphrunner.spec_decode.draft_steps import DraftSteps, greedy_drafts
from graphrunner.spec_decode.eagle_observe import observe_index
from graphrunner.state_table import StateTable
from graphrunner.step_plan import StepShape
from model_states.base import ModelState


@dataclass
class EagleDraft:
    head: nn.Module            # graphrunner.models.eagle.EagleHead
    model_state: ModelState    # model_states.eagle.EagleModelState
    kv_cache: torch.Tensor     # [num_head_layers, 2, num_blocks, block_size, Hkv, D], the target's block ids


class EagleProposer:
    """target: the target model, whose embedding (`embed_input_ids`) and LM head (`compute_logits`) the head
    shares."""

    def __init__(self, config: SpeculativeConfig, draft: EagleDraft, target: nn.Module, state: StateTable,
                 use_triton: bool, attention_backend: str) -> None:
        self.config = config
        self.draft = draft
        self.target = target
        self.state = state
        self.use_triton = use_triton
        self.attention_backend = attention_backend

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def _head(self, inputs: StepInputs, shape: StepShape, input_ids: torch.Tensor, hidden: torch.Tensor
              ) -> torch.Tensor:
        d = self.draft
        meta = d.model_state.prepare_attn(inputs, shape)
        with forward_context(meta, d.kv_cache, self.attention_backend):
            return d.head(self.target.embed_input_ids(input_ids), hidden, inputs.positions)

    def observe(self, idx_mapping: torch.Tensor, inputs: StepInputs, shape: StepShape, hidden: torch.Tensor
                ) -> torch.Tensor:
        """The head over a step's tokens (after its post-update); returns its output at each request's last
        accepted position [B, H]. inputs / shape / hidden [T, H]: the target's forward of the step."""
        t = inputs.input_ids.shape[0]
        next_ids, last = observe_index(idx_mapping, inputs.query_start_loc, inputs.positions, self.state.token_ids,
                                       self.state.num_computed, self.use_triton)  # [T] int64, [B] int64
        out = self._head(inputs, shape, next_ids, hidden[:t])  # [T, H]
        return out.index_select(0, last)  # [B, H]

    def propose(self, idx_mapping: torch.Tensor, inputs: StepInputs, shape: StepShape, hidden: torch.Tensor,
                draft: bool = True) -> None:
        """Observe the step, then (unless `draft` is False: speculation off for the step) k greedy drafts per row
        into its history tail. shape.seq_lens: host upper bounds of each row's num_computed after the step."""
        st, k = self.state, self.config.num_speculative_tokens
        b = idx_mapping.shape[0]
        if b == 0:
            return
        h = self.observe(idx_mapping, inputs, shape, hidden)  # [B, H]
        if not draft:
            return
        steps = DraftSteps(idx_mapping, st, self.draft.model_state.block_size, self.use_triton, shape.seq_lens)
        tok = greedy_drafts(self.target, h, self.use_triton)  # [B] int32 / int64: the first draft
        for i in range(k):
            steps.write(i, tok, next_step=i)  # the head's step i reads draft i
            if i == k - 1:
                break
            # draft i + 1 from the head at position num_computed + i, reading draft i and the head's last output
            h = self._head(*steps.inputs(i), tok, h)  # [B, H]
            tok = greedy_drafts(self.target, h, self.use_triton)  # [B]
