"""The model runner: one step is stage -> prepare -> forward -> sample -> update, all launched
without waiting on the device.

The host contributes only counts it already knows (rows, tokens scheduled, staged diffs, which
sampling stages the batch needs); every per-token input is built on the device from the
persistent state table. The runner's ModelState answers every question about the architecture
(attention metadata, what a forward returns, per-request state). With a GraphDispatcher, a step's
prepare..update replays as one FULL graph, or its forward replays piecewise graphs; the runner
itself never touches a CUDA graph. With speculative decoding, a step holding drafts is a verify step:
1 + k logits rows per decoding request, rejection sampling, and the proposer after the update.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from graphrunner.async_output import AsyncStepOutput, OutputCopier, PromptLogprobSpan, SpecTensors, StepOutput
from graphrunner.attention import forward_context
from graphrunner.host_tensors import to_device
from graphrunner.input_prep import StepBuffers, StepInputs, prepare_inputs
from graphrunner.kv_cache import blocks_needed
from graphrunner.parallel_state import tp_size
from graphrunner.sampling.batch import SampleEntry, SamplingBatch, build_sampling_batch
from graphrunner.sampling.logprobs import LogprobsTensors, prompt_logprobs_chunked
from graphrunner.sampling.sampler import SamplerOutput, run_sampler
from graphrunner.sampling.vocab_parallel import SHARD_SAMPLING_ENABLED, sample_vocab_parallel
from graphrunner.scheduler import SchedulerOutput
from graphrunner.spec_config import SpeculativeConfig
from graphrunner.spec_decode.draft_model import DraftModel, DraftModelProposer
from graphrunner.spec_decode.eagle import EagleDraft, EagleProposer
from graphrunner.spec_decode.layout import SpecLayout, build_spec_layout, uniform_spec_layout
from graphrunner.spec_decode.proposer import NgramProposer
from graphrunner.spec_decode.sampler import verify_sample
from graphrunner.spec_decode.update import post_update_spec
from graphrunner.state_kernels import post_update
from graphrunner.state_table import StateTable
from graphrunner.step_plan import GraphDispatcher, StepBodies, StepMode, StepPlan, StepShape
from model_states.base import ModelState

PROMPT_LOGPROBS_CHUNK = 512  # prompt positions per logits chunk: bounds the [chunk, vocab] buffer


@dataclass
class PromptLogprobsPlan:
    """Prompt positions whose logprobs this step computes: token index in the step, next prompt token."""

    token_index: torch.Tensor  # [P] int64
    next_ids: torch.Tensor     # [P] int32
    num_top: int
    spans: tuple[PromptLogprobSpan, ...]


@dataclass
class StepBatch:
    """Host-side shape of one step plus the small per-step device tensors."""

    plan: StepPlan
    shape: StepShape             # exact counts (num_reqs unpadded); plan.num_tokens is the padded total
    idx_mapping: torch.Tensor    # [B] int32, state-table row of the b-th request
    num_scheduled: torch.Tensor  # [B] int32
    sampling: SamplingBatch      # over the requests, or over the logits rows of a verify step
    prompt_logprobs: PromptLogprobsPlan | None
    spec: SpecLayout | None = None  # a verify step (some request has draft slots)

    @property
    def num_reqs(self) -> int:
        return self.shape.num_reqs


class ModelRunner:
    def __init__(self, model: nn.Module, model_state: ModelState, kv_cache: torch.Tensor, state: StateTable,
                 use_triton: bool, logprobs_mode: str = "raw_logprobs", attention_backend: str = "reference",
                 max_num_tokens: int = 8192, speculative: SpeculativeConfig | None = None,
                 draft: DraftModel | EagleDraft | None = None) -> None:
        self.model = model
        self.model_state = model_state
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, Hkv, D]
        self.state = state
        self.block_size = model_state.block_size
        self.use_triton = use_triton
        self.logprobs_mode = logprobs_mode
        self.attention_backend = attention_backend
        self.device = state.device
        self.outputs = OutputCopier(self.device)
        max_reqs, self.max_model_len = state.padding_row, state.token_ids.shape[1]
        self.spec_k = speculative.num_speculative_tokens if speculative is not None else 0
        # a FULL verify graph of max_reqs requests holds (1 + k) tokens each, even above the token budget
        self.buffers = StepBuffers(max_reqs, max(max_num_tokens, max_reqs * (1 + self.spec_k)),
                                   state.block_table.shape[1], self.device, state.padding_row)
        self.graphs: GraphDispatcher | None = None  # set once the capture manager has captured
        self._drafting = True  # this step's scheduler had speculation on
        self._observing = True  # ... and so the model proposer runs in it
        self.proposer: NgramProposer | DraftModelProposer | EagleProposer | None = None
        if speculative is not None and speculative.method == "ngram":
            self.proposer = NgramProposer(speculative, state, use_triton)
        elif speculative is not None and speculative.method == "eagle":
            if not isinstance(draft, EagleDraft):
                raise ValueError("speculative method 'eagle' needs the EAGLE head (runner built without it)")
            self.proposer = EagleProposer(speculative, draft, model, state, use_triton, attention_backend)
        elif speculative is not None:
            if not isinstance(draft, DraftModel):
                raise ValueError("speculative method 'draft_model' needs the draft model (runner built without it)")
            self.proposer = DraftModelProposer(speculative, draft, state, use_triton, attention_backend)
        # with disable_by_batch_size a plain decode FULL graph of P rows runs the model proposer only for P below it:
        # above it speculation is off, and the proposer's forward is all such a step would pay over one without
        # speculation (6% at batch 64 with an EAGLE head, 17% with the 8-layer draft, seventeenth session)
        model_proposer = isinstance(self.proposer, (DraftModelProposer, EagleProposer))
        self._observe_below = (speculative.disable_by_batch_size if speculative is not None and model_proposer
                               else None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> AsyncStepOutput:
        """Launch one step; the returned output is read after the next step has been launched."""
        batch = self._stage(sched)
        if batch.plan.mode is StepMode.FULL:  # (its graph drafts as it was captured to)
            return self.outputs.launch(self._replay_full(batch))
        # with graphs, a step outside them does not run the draft model's k forwards, which launch kernel by kernel
        # there (~10 ms a draft step for the 8-layer demo draft on the H200's host, seventeenth session): it leaves
        # its rows' drafts as they are, as a step with speculation off does; the draft model still observes it
        self._drafting = sched.spec_active and not (self.graphs is not None
                                                    and isinstance(self.proposer, DraftModelProposer))
        self._observing = sched.spec_active
        inputs = self._prepare(batch)
        if batch.spec is not None:
            return self.outputs.launch(self._verify(batch, inputs))
        hidden = self._forward(batch, inputs)                                    # [T, hidden]
        sampled = self._sample(hidden.index_select(0, inputs.logits_indices), batch.sampling)
        self._update(batch.idx_mapping, batch.num_scheduled, sampled.sampled)
        self._propose(batch.idx_mapping, inputs, self._forward_shape(batch), hidden)
        return self.outputs.launch(StepOutput(sampled.sampled, sampled.nonfinite, sampled.logprobs,
                                              self._prompt_logprobs(batch, hidden),
                                              batch.prompt_logprobs.spans if batch.prompt_logprobs else ()))

    # -- the stages ------------------------------------------------------------------------
    def _stage(self, sched: SchedulerOutput) -> StepBatch:
        """Stage new rows and new blocks, apply them, plan the step, and ship its (padded) rows and counts."""
        for s in sched.scheduled:
            req = s.request
            if s.is_new:
                self.state.stage_new_row(s.row, req.token_array(0, req.num_host_tokens), req.prompt_len,
                                         s.seq_len - s.num_tokens, req.params, req.seed)
                self.model_state.add_request(s.row, req)
            self.state.stage_blocks(s.row, s.first_new_block, s.new_block_ids)
        self.state.apply_staged()
        rows = [s.row for s in sched.scheduled]
        counts = [s.num_tokens for s in sched.scheduled]
        seq_lens = [s.seq_len for s in sched.scheduled]
        b, t = len(rows), sum(counts)
        entries = [SampleEntry(s.row, s.request.params, s.request.sampling, s.request.num_generated - s.samples)
                   for s in sched.scheduled]
        num_spec = [s.num_spec for s in sched.scheduled]
        spec = None
        if any(num_spec):  # a verify step: the sampling batch covers its logits rows, 1 + num_spec per request
            spec = build_spec_layout(rows, counts, num_spec, self.device)
            entries = [e for e, n in zip(entries, num_spec) for _ in range(1 + n)]
            sampling = build_sampling_batch(entries, spec.expanded_idx, self.device)
        else:
            sampling = build_sampling_batch(entries, self.buffers.step_rows[:b], self.device)
        prompt_logprobs = self._plan_prompt_logprobs(sched)
        if self.graphs is None:
            plan = StepPlan(StepMode.EAGER, b, t)
        else:
            # FULL: uniform plain decodes (1 token each) or, with speculation, verify steps with k draft slots each;
            # a mixed FULL graph (prefill chunks beside decodes) samples one token a request: no verify steps
            q = 1 + (num_spec[0] if num_spec else 0)
            # what a FULL graph's sampling does
            covered = sampling.full_graph_ok(self.penalties_in_graph) and prompt_logprobs is None
            uniform = (all(c == q for c in counts) and all(n == q - 1 for n in num_spec)
                       and q in (1, 1 + self.spec_k))
            # a step that runs the model proposer can take a plain decode graph only where that graph runs it
            below = self._observe_below
            full_max = below - 1 if below is not None and sched.spec_active and q == 1 else None
            plan = self.graphs.plan(b, t, max(seq_lens, default=0), covered and uniform, covered and spec is None, q,
                                    full_max_reqs=full_max)
        p = plan.num_reqs  # FULL graphs: rows past b point at the padding row with 0 tokens
        staged = self.buffers.stage_rows(rows, counts, p)
        if self.device.type == "cuda":
            staged = staged.pin_memory()  # a pinned source: the H2D copy below does not wait
        self.buffers.step_rows[:staged.shape[0]].copy_(staged, non_blocking=True)
        idx_mapping, num_scheduled = self.buffers.rows(b, p)
        shape = StepShape(b, t, tuple(counts), tuple(seq_lens))
        return StepBatch(plan, shape, idx_mapping, num_scheduled, sampling, prompt_logprobs, spec)

    def _prepare(self, batch: StepBatch) -> StepInputs:
        cols = blocks_needed(max(batch.shape.seq_lens, default=1), self.block_size)
        n_tok = batch.plan.num_tokens
        return prepare_inputs(batch.idx_mapping, batch.num_scheduled, self.state.token_ids, self.state.num_computed,
                              self.state.block_table, self.block_size, n_tok, cols, self.use_triton,
                              out=self.buffers.views(batch.num_reqs, n_tok, cols))

    @staticmethod
    def _forward_shape(batch: StepBatch) -> StepShape:
        """The shape of this step's forward: its padded token count, its exact rows."""
        return StepShape(batch.num_reqs, batch.plan.num_tokens, batch.shape.query_lens, batch.shape.seq_lens)

    def _forward(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        """The model over this step's tokens (padding included); returns the hidden states [T_pad, hidden]."""
        shape = self._forward_shape(batch)
        mode = self.graphs.forward_mode(batch.plan) if self.graphs is not None else nullcontext()
        with mode:
            return self.run_model(inputs, shape)

    def _verify(self, batch: StepBatch, inputs: StepInputs) -> StepOutput:
        """A verify step after its inputs: forward, logits of every verified position, rejection sampling, the
        update by each row's accepted count, and the next drafts."""
        spec = batch.spec
        assert spec is not None
        hidden = self._forward(batch, inputs)                                    # [T, hidden]
        logits = self.model.compute_logits(hidden.index_select(0, spec.logits_indices))  # [N, V] float32
        out = verify_sample(logits, batch.sampling, spec, batch.idx_mapping, self.state, self.use_triton,
                            self.logprobs_mode)
        post_update_spec(batch.idx_mapping, batch.num_scheduled, spec.num_spec, out.output_ids, out.num_accepted,
                         self.state.token_ids, self.state.num_computed, self.state.num_tokens, self.state.penalties,
                         self.use_triton)
        self._propose(batch.idx_mapping, inputs, self._forward_shape(batch), hidden)
        plp = batch.prompt_logprobs
        return StepOutput(out.output_ids[:, 0].contiguous(), out.nonfinite, out.logprobs,
                          self._prompt_logprobs(batch, hidden), plp.spans if plp else (),
                          SpecTensors(out.output_ids, out.num_accepted, out.num_drafts, spec.first_row))

    def _propose(self, idx_mapping: torch.Tensor, inputs: StepInputs, shape: StepShape, hidden: torch.Tensor,
                 drafting: bool | None = None, observe: bool | None = None) -> None:
        """Drafts for the next step, after the post-update. inputs / shape / hidden [T, hidden]: the step's forward
        (shape.seq_lens: the host upper bounds of each row's num_computed). drafting / observe: None = as this
        step's scheduler decided (a captured graph passes them fixed); a model proposer that does not observe a
        step does nothing in it (its rows lose speculation: Request.proposer_gap)."""
        drafting = self._drafting if drafting is None else drafting
        observe = self._observing if observe is None else observe
        if isinstance(self.proposer, DraftModelProposer):
            if observe:  # it drafts only while speculation is on (and, with graphs, inside them)
                self.proposer.propose(idx_mapping, inputs, shape, draft=drafting)
        elif isinstance(self.proposer, EagleProposer):
            if observe:  # it drafts only while speculation is on
                self.proposer.propose(idx_mapping, inputs, shape, hidden, draft=drafting)
        elif self.proposer is not None:
            self.proposer.propose(idx_mapping)

    @property
    def penalties_in_graph(self) -> bool:
        """FULL graphs apply penalties (from the state table's statistics), so batches with penalties replay them;
        not with vocab-parallel sampling, whose shards never see whole rows."""
        vocab_parallel = tp_size() > 1 and SHARD_SAMPLING_ENABLED
        return self.state.penalties is not None and self.use_triton and not vocab_parallel

    def _sample(self, hidden: torch.Tensor, sampling: SamplingBatch) -> SamplerOutput:
        """Logits of hidden [B, hidden] and the sampled tokens. With tensor parallelism a plain batch samples each
        rank's vocabulary shard and agrees on the winner (graphrunner.sampling.vocab_parallel); others gather."""
        if sampling.plain and tp_size() > 1 and SHARD_SAMPLING_ENABLED:
            logits, vocab_start = self.model.compute_logits_shard(hidden)  # [B, V / ranks]
            sampled, nonfinite = sample_vocab_parallel(
                logits, vocab_start, self.model_state.config.vocab_size, sampling.idx_mapping, self.state.temperature,
                self.state.seeds, self.state.num_tokens, self.use_triton)
            return SamplerOutput(sampled, nonfinite, None)
        logits = self.model.compute_logits(hidden)  # [B, V] float32
        return run_sampler(logits, sampling, self.state, self.use_triton, self.logprobs_mode)

    def _update(self, idx_mapping: torch.Tensor, num_scheduled: torch.Tensor, sampled: torch.Tensor) -> None:
        post_update(idx_mapping, num_scheduled, sampled, self.state.token_ids, self.state.num_computed,
                    self.state.num_tokens, self.use_triton, self.state.penalties)

    def _replay_full(self, batch: StepBatch) -> StepOutput:
        assert self.graphs is not None
        outputs = self.graphs.replay_full(batch.plan)
        # clones: the graph's buffers are rewritten by the next replay before the copy stream reads them
        b = batch.num_reqs
        sampled, nonfinite = outputs[0][:b].clone(), outputs[1][:b].clone()
        if batch.spec is None:
            return StepOutput(sampled, nonfinite)
        q = 1 + self.spec_k
        spec = SpecTensors(outputs[2][:b].clone(), outputs[3][:b].clone(), outputs[4][:b].clone(),
                           tuple(range(0, b * q, q)))
        return StepOutput(sampled, nonfinite, spec=spec)

    # -- prompt logprobs -------------------------------------------------------------------
    def _plan_prompt_logprobs(self, sched: SchedulerOutput) -> PromptLogprobsPlan | None:
        token_index: list[int] = []
        next_ids: list[int] = []
        spans: list[PromptLogprobSpan] = []
        num_top = 0
        start = 0
        for s in sched.scheduled:
            req = s.request
            first = s.seq_len - s.num_tokens
            # prompt logprobs are the same for every completion of a request: only index 0 computes them
            if req.params.prompt_logprobs is not None and req.index == 0 and first < req.prompt_len - 1:
                last = min(s.seq_len, req.prompt_len - 1)  # position p predicts prompt token p + 1
                token_index += range(start, start + last - first)
                next_ids += req.prompt_token_ids[first + 1:last + 1]
                spans.append(PromptLogprobSpan(req.parent_id, first, last - first))
                num_top = max(num_top, req.params.prompt_logprobs)
            start += s.num_tokens
        if not spans:
            return None
        return PromptLogprobsPlan(to_device(token_index, torch.int64, self.device),
                                  to_device(next_ids, torch.int32, self.device), num_top, tuple(spans))

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> LogprobsTensors | None:
        plan = batch.prompt_logprobs
        if plan is None:
            return None
        return prompt_logprobs_chunked(hidden.index_select(0, plan.token_index), self.model.compute_logits,
                                       plan.next_ids, plan.num_top, PROMPT_LOGPROBS_CHUNK, self.use_triton)

    # -- the forward, and the bodies capture records ------------------------------------------
    @contextmanager
    def first_step_inputs(self, num_tokens: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids [T], positions [T]) of a dummy prefill of num_tokens (views of the step buffers), in inference
        mode with the attention context set: the call a compiled model meets first (the memory profile's step)."""
        with torch.inference_mode():
            inputs, shape = self.model_state.dummy_inputs(self.buffers, num_tokens, prefill=True)
            meta = self.model_state.prepare_attn(inputs, shape)
            with forward_context(meta, self.kv_cache, self.attention_backend):
                yield inputs.input_ids, inputs.positions

    def run_model(self, inputs: StepInputs, shape: StepShape) -> torch.Tensor:
        """The model over prepared inputs with its attention context set; hidden states [T, hidden]."""
        meta = self.model_state.prepare_attn(inputs, shape)
        with forward_context(meta, self.kv_cache, self.attention_backend):
            return self.model_state.forward(self.model, inputs.input_ids, inputs.positions).hidden

    def full_step_body(self, num_reqs: int, num_tokens: int, num_splits: int,
                       mixed: bool) -> tuple[torch.Tensor, ...]:
        """The FULL graph of a step over the first `num_reqs` step rows and `num_tokens` tokens: prepare,
        forward, logits, Gumbel/argmax sampling, post-update (and, with speculation, the proposal). Returns
        (sampled [P] int32, nonfinite [P] bool).

        A uniform decode has num_reqs tokens; a mixed graph takes any query lengths summing to at most num_tokens
        (its attention grid covers a query of num_tokens tokens in one row; the device reads each request's real
        length). A speculative engine's uniform graph of num_reqs * (1 + k) tokens is a verify step
        (full_verify_body)."""
        if not mixed and num_tokens != num_reqs:
            if num_tokens != num_reqs * (1 + self.spec_k):
                raise ValueError(f"a uniform FULL step of {num_tokens} tokens for {num_reqs} requests needs "
                                 f"num_speculative_tokens = {num_tokens // max(num_reqs, 1) - 1}, this engine has "
                                 f"{self.spec_k}")
            return self.full_verify_body(num_reqs, num_splits)
        idx, counts = self.buffers.rows(num_reqs, num_reqs)
        cols = self.buffers.max_block_cols  # the whole table: a graph's shapes cannot follow the batch's lengths
        inputs = prepare_inputs(idx, counts, self.state.token_ids, self.state.num_computed, self.state.block_table,
                                self.block_size, num_tokens, cols, self.use_triton,
                                out=self.buffers.views(num_reqs, num_tokens, cols))
        query_lens = (num_tokens,) + (0,) * (num_reqs - 1) if mixed else (1,) * num_reqs
        shape = StepShape(num_reqs, num_tokens, query_lens, (self.max_model_len,) * num_reqs, num_splits)
        hidden = self.run_model(inputs, shape)                                  # [T, hidden]
        # a mixed graph runs the model proposer (a prefill that just ended verifies next); a plain decode one only
        # observes with it, and only below disable_by_batch_size (a decode with speculation on whose rows have no
        # draft slots: min_tokens not reached); stale drafts stay valid proposals
        observe = mixed or self._observe_below is None or num_reqs < self._observe_below
        # penalties run in the graph for every row (neutral rows return at once): a batch with penalties replays it
        sampling = SamplingBatch(idx, False, self.penalties_in_graph, False, -1)
        out = self._sample(hidden.index_select(0, inputs.logits_indices), sampling)
        self._update(idx, counts, out.sampled)
        self._propose(idx, inputs, shape, hidden,
                      drafting=mixed or not isinstance(self.proposer, (DraftModelProposer, EagleProposer)),
                      observe=observe)
        return out.sampled, out.nonfinite

    def full_verify_body(self, num_reqs: int, num_splits: int) -> tuple[torch.Tensor, ...]:
        """The FULL graph of a uniform verify step (1 + k tokens for each of the first `num_reqs` step rows, padding
        rows 0): prepare, forward, logits of every token, rejection sampling, post-update by the accepted counts,
        n-gram proposal. Returns (sampled [P], nonfinite [P], output_ids [P, K + 1], num_accepted [P],
        num_drafts [P])."""
        idx, counts = self.buffers.rows(num_reqs, num_reqs)
        q = 1 + self.spec_k
        cols = self.buffers.max_block_cols
        inputs = prepare_inputs(idx, counts, self.state.token_ids, self.state.num_computed, self.state.block_table,
                                self.block_size, num_reqs * q, cols, self.use_triton,
                                out=self.buffers.views(num_reqs, num_reqs * q, cols))
        shape = StepShape(num_reqs, num_reqs * q, (q,) * num_reqs, (self.max_model_len,) * num_reqs, num_splits)
        hidden = self.run_model(inputs, shape)                                  # [P * q, hidden]
        layout = uniform_spec_layout(idx, counts, self.spec_k)
        logits = self.model.compute_logits(hidden)                              # [P * q, V] float32
        out = verify_sample(logits, SamplingBatch(layout.expanded_idx, False, False, False, -1), layout, idx,
                            self.state, self.use_triton)
        post_update_spec(idx, counts, layout.num_spec, out.output_ids, out.num_accepted, self.state.token_ids,
                         self.state.num_computed, self.state.num_tokens, self.state.penalties, self.use_triton)
        self._propose(idx, inputs, shape, hidden, drafting=True, observe=True)
        return out.output_ids[:, 0].contiguous(), out.nonfinite, out.output_ids, out.num_accepted, out.num_drafts

    def release_graphs(self) -> None:
        """Drop every CUDA graph (FULL and piecewise); later steps run eagerly. With tensor parallelism this comes
        before leaving the process group: NCCL cannot free a communicator while a live graph holds its collectives."""
        graphs, self.graphs = self.graphs, None
        retire = getattr(graphs, "retire", None)
        if retire is not None:
            retire()

    def capture_bodies(self) -> StepBodies:
        return StepBodies(forward=self.run_model, full_step=self.full_step_body)
