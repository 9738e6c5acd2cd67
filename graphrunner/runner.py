"""The model runner: one step is stage -> prepare -> forward -> sample -> update, all launched
without waiting on the device.

The host contributes only counts it already knows (rows, tokens scheduled, staged diffs, which
sampling stages the batch needs); every per-token input is built on the device from the
persistent state table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.async_output import AsyncStepOutput, OutputCopier
from graphrunner.attention import AttentionMetadata, forward_context
from graphrunner.input_prep import StepInputs, prepare_inputs
from graphrunner.kv_cache import blocks_needed
from graphrunner.sampling.batch import SampleEntry, SamplingBatch, build_sampling_batch
from graphrunner.sampling.logprobs import prompt_logprobs_chunked
from graphrunner.sampling.sampler import run_sampler
from graphrunner.scheduler import SchedulerOutput
from graphrunner.state_kernels import post_update
from graphrunner.state_table import StateTable, to_device

PROMPT_LOGPROBS_CHUNK = 512  # prompt positions per logits chunk: bounds the [chunk, vocab] buffer


@dataclass
class PromptLogprobsPlan:
    """Prompt positions whose logprobs this step computes: token index in the step, next prompt token."""

    token_index: torch.Tensor  # [P] int64
    next_ids: torch.Tensor     # [P] int32
    num_top: int
    spans: list[tuple[int, int, int, str]]  # (batch row, first prompt position, count, parent id) per request


@dataclass
class StepBatch:
    """Host-side shape of one step plus the small per-step device tensors."""

    num_reqs: int
    num_tokens: int
    query_lens: list[int]
    seq_lens: list[int]
    idx_mapping: torch.Tensor    # [B] int32, state-table row of the b-th request
    num_scheduled: torch.Tensor  # [B] int32
    sampling: SamplingBatch
    prompt_logprobs: PromptLogprobsPlan | None


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, state: StateTable, block_size: int,
                 use_triton: bool, logprobs_mode: str = "raw_logprobs", attention_backend: str = "reference") -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        self.state = state
        self.block_size = block_size
        self.use_triton = use_triton
        self.logprobs_mode = logprobs_mode
        self.attention_backend = attention_backend
        self.device = state.device
        self.outputs = OutputCopier(self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> AsyncStepOutput:
        """Launch one step; the returned output is read after the next step has been launched."""
        batch = self._stage(sched)
        inputs = self._prepare(batch)
        hidden = self._forward(batch, inputs)                                    # [T, hidden]
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))  # [B, V] float32
        out = run_sampler(logits, batch.sampling, self.state, self.use_triton, self.logprobs_mode)
        post_update(batch.idx_mapping, batch.num_scheduled, out.sampled, self.state.token_ids,
                    self.state.num_computed, self.state.num_tokens, self.use_triton)
        results = {"sampled": out.sampled, "nonfinite": out.nonfinite}
        if out.logprobs is not None:
            results.update(_flatten("lp", out.logprobs))
        info: dict[str, object] = {}
        if batch.prompt_logprobs is not None:
            plan = batch.prompt_logprobs
            plp = prompt_logprobs_chunked(hidden.index_select(0, plan.token_index), self.model.compute_logits,
                                          plan.next_ids, plan.num_top, PROMPT_LOGPROBS_CHUNK, self.use_triton)
            results.update(_flatten("plp", plp))
            info["prompt_logprob_spans"] = plan.spans
        return self.outputs.launch(results, info)

    def _stage(self, sched: SchedulerOutput) -> StepBatch:
        """Stage new rows and new blocks, apply them, and ship idx_mapping / num_scheduled."""
        for s in sched.scheduled:
            req = s.request
            if s.is_new:
                self.state.stage_new_row(s.row, req.all_token_ids(), req.prompt_len, s.seq_len - s.num_tokens,
                                         req.params, req.seed)
            self.state.stage_blocks(s.row, s.first_new_block, s.new_block_ids)
        self.state.apply_staged()
        rows = [s.row for s in sched.scheduled]
        counts = [s.num_tokens for s in sched.scheduled]
        both = to_device(rows + counts, torch.int32, self.device)  # [2B] int32, one H2D copy
        b = len(rows)
        entries = [SampleEntry(s.row, s.request.params, s.request.sampling, s.request.num_generated - s.samples)
                   for s in sched.scheduled]
        return StepBatch(b, sum(counts), counts, [s.seq_len for s in sched.scheduled], both[:b], both[b:],
                         build_sampling_batch(entries, both[:b], self.device), self._plan_prompt_logprobs(sched))

    def _plan_prompt_logprobs(self, sched: SchedulerOutput) -> PromptLogprobsPlan | None:
        token_index: list[int] = []
        next_ids: list[int] = []
        spans: list[tuple[int, int, int, str]] = []
        num_top = 0
        start = 0
        for b, s in enumerate(sched.scheduled):
            req = s.request
            first = s.seq_len - s.num_tokens
            # prompt logprobs are the same for every completion of a request: only index 0 computes them
            if req.params.prompt_logprobs is not None and req.index == 0 and first < req.prompt_len - 1:
                last = min(s.seq_len, req.prompt_len - 1)  # position p predicts prompt token p + 1
                token_index += range(start, start + last - first)
                next_ids += req.prompt_token_ids[first + 1:last + 1]
                spans.append((b, first, last - first, req.parent_id))
                num_top = max(num_top, req.params.prompt_logprobs)
            start += s.num_tokens
        if not spans:
            return None
        return PromptLogprobsPlan(to_device(token_index, torch.int64, self.device),
                                  to_device(next_ids, torch.int32, self.device), num_top, spans)

    def _prepare(self, batch: StepBatch) -> StepInputs:
        cols = blocks_needed(max(batch.seq_lens, default=1), self.block_size)
        return prepare_inputs(batch.idx_mapping, batch.num_scheduled, self.state.token_ids, self.state.num_computed,
                              self.state.block_table, self.block_size, batch.num_tokens, cols, self.use_triton)

    def _forward(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        """Run the model over this step's tokens; returns the hidden states [T, hidden]."""
        meta = AttentionMetadata(
            num_reqs=batch.num_reqs, num_tokens=batch.num_tokens, max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(batch.seq_lens, default=0), block_size=self.block_size,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping, query_lens_cpu=batch.query_lens, seq_lens_cpu=batch.seq_lens,
        )
        with forward_context(meta, self.kv_cache, self.attention_backend):
            return self.model(inputs.input_ids, inputs.positions)


def _flatten(prefix: str, lp: object) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": getattr(lp, name) for name in ("top_ids", "top_logprobs", "token_logprob",
                                                               "token_rank")}
