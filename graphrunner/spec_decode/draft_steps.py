"""The k one-token draft steps that the model proposers (draft model, EAGLE head) share: step i of row r reads
token_ids[r, num_computed + i] at that position (the row's last token, then the drafts just written), and draft i
goes into the row's history tail at num_tokens + i, where the next verify step's prep kernel reads it.
"""

from __future__ import annotations

import torch

from graphrunner.input_prep import StepInputs, prepare_inputs
from graphrunner.spec_decode.update import write_tail
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
        self.rows = idx_mapping.long()  # [B] int64
        self.num_computed = st.num_computed.index_select(0, self.rows)  # [B] int32: each row's last-token position
        self.num_tokens = st.num_tokens.index_select(0, self.rows).long()  # [B] int64
        self.ones = torch.ones(self.num_reqs, dtype=torch.int32, device=idx_mapping.device)  # [B] int32
        self.positions = st.num_computed.clone()  # [R] int32, a scratch copy the prep kernel reads

    def inputs(self, i: int) -> tuple[StepInputs, StepShape]:
        """Step i's one-token inputs; a position past the row is clamped to its last one (a request at
        max_model_len: nothing is used there)."""
        st, b = self.state, self.num_reqs
        self.positions.index_copy_(0, self.rows, (self.num_computed + i).clamp(max=self.max_len - 1))
        inputs = prepare_inputs(self.idx_mapping, self.ones, st.token_ids, self.positions, st.block_table,
                                self.block_size, b, st.block_table.shape[1], self.use_triton)
        shape = StepShape(b, b, (1,) * b, tuple(min(s + i + 1, self.max_len) for s in self.seq_lens_upper))
        return inputs, shape

    def write(self, i: int, tokens: torch.Tensor) -> None:
        """Draft i (tokens [B]) into each row's history tail, where it fits."""
        room = (self.num_tokens + i < self.max_len).to(torch.int64)  # [B] int64
        write_tail(self.state.token_ids, self.rows, self.num_tokens + i, tokens[:, None], room)

    def finish(self, k: int) -> None:
        """Record how many of the k drafts each row holds (those that fit)."""
        counts = (self.max_len - self.num_tokens).clamp(0, k).to(torch.int32)  # [B] int32
        self.state.num_drafts.index_copy_(0, self.rows, counts)
