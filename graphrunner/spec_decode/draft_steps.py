"""The k one-token draft steps that the model proposers (draft model, EAGLE head) share: step i of row r reads
token_ids[r, num_computed + i] at that position (the row's last token, then the drafts just written), and draft i
goes into the row's history tail at num_tokens + i, where the next verify step's prep kernel reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrunner.input_prep import StepInputs, prepare_inputs
from graphrunner.parallel_state import tp_size
from graphrunner.sampling.gumbel_split import greedy_argmax
from graphrunner.spec_decode.update import advance_draft
from graphrunner.state_table import StateTable
from graphrunner.step_plan import StepShape


class DraftSteps:
    """One proposal round over the rows of idx_mapping [B] int32 (after the step's post-update). seq_lens_upper:
    host upper bounds of each row's num_computed (the step's StepShape.seq_lens). No host syncs."""

    def __init__(self, idx_mapping: torch.Tensor, state: StateTable, block_size: int, use_triton: bool,
                 seq_lens_upper: tuple[int, ...]) -> None:
        st = state
        self.idx_mapping, self.state, self.block_size, self.use_triton = idx_mapping, st, block_size, use_triton
        self.seq_lens_upper = seq_lens_upper
        self.num_reqs = idx_mapping.shape[0]
        self.max_len = st.token_ids.shape[1]
        self.ones = torch.ones(self.num_reqs, dtype=torch.int32, device=idx_mapping.device)  # [B] int32
        # [R] int32: the num_computed each draft step's prep kernel reads; step 0 at each row's last token, then
        # write() moves it on (a position past the row is clamped to its last one: a request at max_model_len,
        # nothing is used there)
        self.positions = st.num_computed.clamp(max=self.max_len - 1)
        self.prepared = 0  # the step whose position `positions` holds

    def inputs(self, i: int) -> tuple[StepInputs, StepShape]:
        """Step i's one-token inputs (at position num_computed + i: step 0, or the `next_step` of the last
        write)."""
        if i != self.prepared:
            raise RuntimeError(f"draft step {i}'s inputs asked for, but step {self.prepared}'s are prepared")
        st, b = self.state, self.num_reqs
        inputs = prepare_inputs(self.idx_mapping, self.ones, st.token_ids, self.positions, st.block_table,
                                self.block_size, b, st.block_table.shape[1], self.use_triton)
        shape = StepShape(b, b, (1,) * b, tuple(min(s + i + 1, self.max_len) for s in self.seq_lens_upper))
        return inputs, shape

    def write(self, i: int, tokens: torch.Tensor, next_step: int) -> None:
        """Draft i (tokens [B]) into each row's history tail, where it fits; the rows' draft counts follow, and the
        position of step `next_step`, whose inputs are asked for next (one launch on the device)."""
        st = self.state
        advance_draft(self.idx_mapping, i, next_step, tokens, st.token_ids, st.num_computed, st.num_tokens,
                      self.positions, st.num_drafts, self.use_triton)
        self.prepared = next_step


def greedy_drafts(model: nn.Module, hidden: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """The greedy draft token [B] (int32 or int64) of each row of hidden [B, H] through `model`'s LM head. On one
    rank its model-dtype logits go straight to the split argmax; with tensor parallelism the gathered ones."""
    if tp_size() > 1:
        return model.compute_logits(hidden).argmax(dim=-1)
    logits, _ = model.compute_logits_shard(hidden)  # [B, V] model dtype
    return greedy_argmax(logits[:, :model.config.vocab_size], use_triton)
