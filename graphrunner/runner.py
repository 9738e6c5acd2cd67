"""The model runner: one step is stage -> prepare -> forward -> sample -> update, all launched
without waiting on the device.

The host contributes only counts it already knows (rows, tokens scheduled, staged diffs); every
per-token input is built on the device from the persistent state table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.async_output import AsyncStepOutput, OutputCopier
from graphrunner.attention import AttentionMetadata, forward_context
from graphrunner.input_prep import StepInputs, prepare_inputs
from graphrunner.kv_cache import blocks_needed
from graphrunner.sampling import sample
from graphrunner.scheduler import SchedulerOutput
from graphrunner.state_kernels import post_update
from graphrunner.state_table import StateTable, to_device


@dataclass
class StepBatch:
    """Host-side shape of one step plus the two small per-step device tensors."""

    num_reqs: int
    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    idx_mapping: torch.Tensor    # [B] int32, state-table row of the b-th request
    num_scheduled: torch.Tensor  # [B] int32


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, state: StateTable, block_size: int,
                 use_triton: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        self.state = state
        self.block_size = block_size
        self.use_triton = use_triton
        self.device = state.device
        self.outputs = OutputCopier(self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> AsyncStepOutput:
        """Launch one step; the returned output is read after the next step has been launched."""
        batch = self._stage(sched)
        inputs = self._prepare(batch)
        logits = self._forward(batch, inputs)
        sampled = sample(logits, batch.idx_mapping, self.state.temperature, self.state.seeds,
                         self.state.num_tokens, self.use_triton)
        post_update(batch.idx_mapping, batch.num_scheduled, sampled, self.state.token_ids,
                    self.state.num_computed, self.state.num_tokens, self.use_triton)
        return self.outputs.launch(sampled)

    def _stage(self, sched: SchedulerOutput) -> StepBatch:
        """Stage new rows and new blocks, apply them, and ship idx_mapping / num_scheduled."""
        for s in sched.scheduled:
            req = s.request
            if s.is_new:
                self.state.stage_new_row(s.row, req.all_token_ids(), s.seq_len - s.num_tokens,
                                         req.params.temperature, req.seed)
            self.state.stage_blocks(s.row, s.first_new_block, s.new_block_ids)
        self.state.apply_staged()
        rows = [s.row for s in sched.scheduled]
        counts = [s.num_tokens for s in sched.scheduled]
        both = to_device(rows + counts, torch.int32, self.device)  # [2B] int32, one H2D copy
        b = len(rows)
        return StepBatch(b, sum(counts), counts, [s.seq_len for s in sched.scheduled], both[:b], both[b:])

    def _prepare(self, batch: StepBatch) -> StepInputs:
        cols = blocks_needed(max(batch.seq_lens, default=1), self.block_size)
        return prepare_inputs(batch.idx_mapping, batch.num_scheduled, self.state.token_ids, self.state.num_computed,
                              self.state.block_table, self.block_size, batch.num_tokens, cols, self.use_triton)

    def _forward(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        """Run the model over this step's tokens; returns logits of each request's last token [B, V]."""
        meta = AttentionMetadata(
            num_reqs=batch.num_reqs, num_tokens=batch.num_tokens, max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(batch.seq_lens, default=0), block_size=self.block_size,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping, query_lens_cpu=batch.query_lens, seq_lens_cpu=batch.seq_lens,
        )
        with forward_context(meta, self.kv_cache):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))  # [B, V] float32
