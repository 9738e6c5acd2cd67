"""The model runner: one step is stage -> prepare -> forward -> sample -> update, all launched
without waiting on the device.

The host contributes only counts it already knows (rows, tokens scheduled, staged diffs, which
sampling stages the batch needs); every per-token input is built on the device from the
persistent state table. With a GraphDispatcher, a step's prepare..update replays as one FULL
graph, or its forward replays piecewise graphs; the runner itself never touches a CUDA graph.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.async_output import AsyncStepOutput, OutputCopier
from graphrunner.attention import AttentionMetadata, forward_context
from graphrunner.input_prep import StepBuffers, StepInputs, prepare_inputs
from graphrunner.kv_cache import blocks_needed
from graphrunner.sampling.batch import SampleEntry, SamplingBatch, build_sampling_batch
from graphrunner.sampling.logprobs import prompt_logprobs_chunked
from graphrunner.sampling.sampler import run_sampler
from graphrunner.scheduler import SchedulerOutput
from graphrunner.state_kernels import post_update
from graphrunner.state_table import StateTable, to_device
from graphrunner.step_plan import GraphDispatcher, StepMode, StepPlan

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
    plan: StepPlan
    query_lens: list[int]
    seq_lens: list[int]
    idx_mapping: torch.Tensor    # [B] int32, state-table row of the b-th request
    num_scheduled: torch.Tensor  # [B] int32
    sampling: SamplingBatch
    prompt_logprobs: PromptLogprobsPlan | None


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, state: StateTable, block_size: int,
                 use_triton: bool, logprobs_mode: str = "raw_logprobs", attention_backend: str = "reference",
                 max_num_tokens: int = 8192) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        self.state = state
        self.block_size = block_size
        self.use_triton = use_triton
        self.logprobs_mode = logprobs_mode
        self.attention_backend = attention_backend
        self.device = state.device
        self.outputs = OutputCopier(self.device)
        max_reqs, self.max_model_len = state.padding_row, state.token_ids.shape[1]
        self.max_block_cols = state.block_table.shape[1]
        self.buffers = StepBuffers(max_reqs, max(max_num_tokens, max_reqs), self.max_block_cols, self.device)
        # [2 * P] int32: a step's P (padded) state-table rows, then its P token counts, in one H2D copy
        self.step_rows = torch.zeros(2 * max_reqs, dtype=torch.int32, device=self.device)
        self.graphs: GraphDispatcher | None = None  # set once the capture manager has captured

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> AsyncStepOutput:
        """Launch one step; the returned output is read after the next step has been launched."""
        batch = self._stage(sched)
        if batch.plan.mode is StepMode.FULL:
            assert self.graphs is not None
            sampled, nonfinite = self.graphs.replay_full(batch.plan)
            # clones: the graph's buffers are rewritten by the next replay before the copy stream reads them
            b = batch.num_reqs
            return self.outputs.launch({"sampled": sampled[:b].clone(), "nonfinite": nonfinite[:b].clone()})
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
        """Stage new rows and new blocks, apply them, plan the step, and ship its (padded) rows and counts."""
        for s in sched.scheduled:
            req = s.request
            if s.is_new:
                self.state.stage_new_row(s.row, req.all_token_ids(), req.prompt_len, s.seq_len - s.num_tokens,
                                         req.params, req.seed)
            self.state.stage_blocks(s.row, s.first_new_block, s.new_block_ids)
        self.state.apply_staged()
        rows = [s.row for s in sched.scheduled]
        counts = [s.num_tokens for s in sched.scheduled]
        seq_lens = [s.seq_len for s in sched.scheduled]
        b, t = len(rows), sum(counts)
        entries = [SampleEntry(s.row, s.request.params, s.request.sampling, s.request.num_generated - s.samples)
                   for s in sched.scheduled]
        sampling = build_sampling_batch(entries, self.step_rows[:b], self.device)
        prompt_logprobs = self._plan_prompt_logprobs(sched)
        if self.graphs is None:
            plan = StepPlan(StepMode.EAGER, b, t)
        else:
            full_ok = t == b and sampling.plain and prompt_logprobs is None
            plan = self.graphs.plan(b, t, max(seq_lens, default=0), full_ok)
        pad = plan.num_reqs - b  # FULL graphs: extra rows point at the padding row with 0 tokens
        host = rows + [self.state.padding_row] * pad + counts + [0] * pad
        p = plan.num_reqs
        staged = torch.tensor(host, dtype=torch.int32)
        if self.device.type == "cuda":
            staged = staged.pin_memory()  # a pinned source: the H2D copy below does not wait
        self.step_rows[:2 * p].copy_(staged, non_blocking=True)
        return StepBatch(b, t, plan, counts, seq_lens, self.step_rows[:b], self.step_rows[p:p + b], sampling,
                         prompt_logprobs)

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
        n_tok = batch.plan.num_tokens
        return prepare_inputs(batch.idx_mapping, batch.num_scheduled, self.state.token_ids, self.state.num_computed,
                              self.state.block_table, self.block_size, n_tok, cols, self.use_triton,
                              out=self.buffers.views(batch.num_reqs, n_tok, cols))

    def _forward(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        """Run the model over this step's tokens (padding included); returns the hidden states [T_pad, hidden]."""
        meta = AttentionMetadata(
            num_reqs=batch.num_reqs, num_tokens=batch.plan.num_tokens, max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(batch.seq_lens, default=0), block_size=self.block_size,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping, query_lens_cpu=batch.query_lens, seq_lens_cpu=batch.seq_lens,
        )
        mode = self.graphs.forward_mode(batch.plan) if self.graphs is not None else nullcontext()
        with forward_context(meta, self.kv_cache, self.attention_backend), mode:
            return self.model(inputs.input_ids, inputs.positions)

    # -- bodies the capture manager records ------------------------------------------------
    def full_decode_body(self, num_reqs: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The FULL graph of a uniform decode over the first `num_reqs` entries of step_rows: prepare, forward,
        logits, Gumbel/argmax sampling, post-update. Returns (sampled [P] int32, nonfinite [P] bool)."""
        idx, counts = self.step_rows[:num_reqs], self.step_rows[num_reqs:2 * num_reqs]
        cols = self.max_block_cols  # the whole table: a graph's shapes cannot follow the batch's lengths
        inputs = prepare_inputs(idx, counts, self.state.token_ids, self.state.num_computed, self.state.block_table,
                                self.block_size, num_reqs, cols, self.use_triton,
                                out=self.buffers.views(num_reqs, num_reqs, cols))
        meta = AttentionMetadata(
            num_reqs=num_reqs, num_tokens=num_reqs, max_query_len=1, max_seq_len=self.max_model_len,
            block_size=self.block_size, query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
            block_table=inputs.block_table, slot_mapping=inputs.slot_mapping, query_lens_cpu=[1] * num_reqs,
            seq_lens_cpu=[self.max_model_len] * num_reqs, backend_cache={"num_splits": num_splits})
        with forward_context(meta, self.kv_cache, self.attention_backend):
            hidden = self.model(inputs.input_ids, inputs.positions)              # [P, hidden]
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))  # [P, V] float32
        out = run_sampler(logits, SamplingBatch(idx, False, False, False, -1), self.state, self.use_triton)
        post_update(idx, counts, out.sampled, self.state.token_ids, self.state.num_computed, self.state.num_tokens,
                    self.use_triton)
        return out.sampled, out.nonfinite

    def fill_padding_rows(self, num_reqs: int) -> None:
        """Point the first num_reqs step rows at the padding row with 0 tokens (capture's dummy batch)."""
        self.step_rows[:num_reqs].fill_(self.state.padding_row)
        self.step_rows[num_reqs:2 * num_reqs].zero_()

    def dummy_forward(self, num_tokens: int) -> torch.Tensor:
        """The model over num_tokens padding tokens (no request, no KV written), through the step buffers."""
        inputs = self.buffers.views(0, num_tokens, 0)
        meta = AttentionMetadata(
            num_reqs=0, num_tokens=num_tokens, max_query_len=0, max_seq_len=0, block_size=self.block_size,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_table=inputs.block_table,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device))
        with forward_context(meta, self.kv_cache, self.attention_backend):
            return self.model(inputs.input_ids, inputs.positions)


def _flatten(prefix: str, lp: object) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": getattr(lp, name) for name in ("top_ids", "top_logprobs", "token_logprob",
                                                               "token_rank")}
