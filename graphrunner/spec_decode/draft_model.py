"""The draft-model proposer (vLLM's method="draft_model"): a smaller model with the same vocabulary, its
own ModelState and KV cache, indexed by the target's block table and slots (same block ids, its own tensor).

After each step's post-update the draft model observes the step: each request's scheduled positions and the one
after them, whose token the step just made known (the sampled or bonus token, the next prompt token). Its KV then
holds every position up to num_computed (rejected drafts' positions are rewritten, like the target's), and its
output at num_computed is the first greedy draft; k - 1 single-token forwards give the rest, each written into the
row's history tail. So a verify step runs k draft-model passes, not k + 1. The scheduler reserves k positions of KV
blocks ahead for these writes. Nothing here syncs with the host, so a FULL verify graph records these forwards too
(on a GPU the worker compiles the draft model with plain Inductor: capture.compiled.compile_draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.attention import forward_context
from graphrunner.input_prep import StepInputs, prepare_inputs
from graphrunner.spec_config import SpeculativeConfig
from graphrunner.spec_decode.draft_observe import observe_counts
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
        # [R] int32: each row's first position in the step being observed (the post-update has moved num_computed)
        self._starts = torch.zeros_like(state.num_computed)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def _forward(self, inputs: StepInputs, shape: StepShape) -> torch.Tensor:
        d = self.draft
        meta = d.model_state.prepare_attn(inputs, shape)
        with forward_context(meta, d.kv_cache, self.attention_backend):
            return d.model_state.forward(d.model, inputs.input_ids, inputs.positions).hidden

    def observe(self, idx_mapping: torch.Tensor, inputs: StepInputs, shape: StepShape) -> torch.Tensor:
        """The draft model over a step's tokens and the one after each request's (after the step's post-update);
        returns its hidden state at each request's num_computed [B, H]. inputs / shape: the target's forward."""
        st = self.state
        max_len = st.token_ids.shape[1]
        b, t = idx_mapping.shape[0], inputs.positions.shape[0] + idx_mapping.shape[0]
        counts, last = observe_counts(idx_mapping, inputs.query_start_loc, inputs.positions, st.num_computed,
                                      self._starts, max_len, self.use_triton)  # [B] int32, [B] int64
        obs = prepare_inputs(idx_mapping, counts, st.token_ids, self._starts, st.block_table,
                             self.draft.model_state.block_size, t, st.block_table.shape[1], self.use_triton)
        # host upper bounds: one more token a request (a request with none, as a captured graph's rows past the
        # first of a mixed step say, still has none)
        obs_shape = StepShape(b, t, tuple(q + 1 if q else 0 for q in shape.query_lens),
                              tuple(min(s + 1, max_len) for s in shape.seq_lens), shape.num_splits)
        return self._forward(obs, obs_shape).index_select(0, last)  # [B, H]

    def propose(self, idx_mapping: torch.Tensor, inputs: StepInputs, shape: StepShape, draft: bool = True) -> None:
        """Observe the step, then (unless `draft` is False: no proposal round in this step) k greedy draft tokens
        per row into its history tail. shape.seq_lens: host upper bounds of each row's num_computed after the
        step."""
        if idx_mapping.shape[0] == 0:
            return
        h = self.observe(idx_mapping, inputs, shape)  # [B, H]
        if not draft:
            return
        k = self.config.num_speculative_tokens
        steps = DraftSteps(idx_mapping, self.state, self.draft.model_state.block_size, self.use_triton,
                           shape.seq_lens)
        tok = greedy_drafts(self.draft.model, h, self.use_triton)  # [B]: the first draft
        for i in range(k):
            steps.write(i, tok, next_step=i + 1)  # draft step i + 1 reads draft i, at num_computed + i + 1
            if i == k - 1:
                break
            tok = greedy_drafts(self.draft.model, self._forward(*steps.inputs(i + 1)), self.use_triton)  # [B]
