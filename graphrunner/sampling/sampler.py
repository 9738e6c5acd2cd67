"""The sampler: masks and bias -> penalties -> temperature -> min-p / top-k / top-p -> Gumbel-max,
plus logprobs, with every stage skipped when no request in the batch uses it.

Per-request parameters are read on the device through idx_mapping from the state table; the
order of stages is vLLM's. Rows whose raw logits hold NaN or inf are flagged for the host, which
ends those requests with finish_reason "error".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner.penalty_counts import PenaltyCounts
from graphrunner.sampling import gumbel_split
from graphrunner.sampling.batch import SamplingBatch
from graphrunner.sampling.filters import apply_filters
from graphrunner.sampling.gumbel_split import sample
from graphrunner.sampling.logprobs import LogprobsTensors, compute_logprobs
from graphrunner.sampling.masks import apply_allowed_tokens, apply_bad_word_prefixes, apply_sparse_edits
from graphrunner.sampling.penalties import apply_penalties
from graphrunner.state_table import StateTable

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class SamplerOutput:
    sampled: torch.Tensor                # [B] int32
    nonfinite: torch.Tensor              # [B] bool: the row's raw logits held NaN or inf
    logprobs: LogprobsTensors | None     # for the sampled tokens, when any request asked


def _penalty_counts(state: StateTable) -> PenaltyCounts:
    if state.penalties is None:
        raise ValueError("a batch with penalties needs the state table's penalty statistics (built without "
                         "vocab_size)")
    return state.penalties


def run_sampler(logits: torch.Tensor, batch: SamplingBatch, state: StateTable, use_triton: bool,
                logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """logits [B, V] float32 (owned by the caller's step; modified in place)."""
    idx = batch.idx_mapping
    raw_logprobs = batch.num_logprobs >= 0 and logprobs_mode == "raw_logprobs"
    untouched = batch.allowed is None and batch.sparse is None and batch.bad_words is None
    fast = batch.all_greedy or not (batch.use_filters or (batch.num_logprobs >= 0 and not raw_logprobs))
    if use_triton and untouched and fast and gumbel_split.SPLIT_SAMPLE_ENABLED and not (
            batch.use_penalties and batch.num_logprobs >= 0):
        # The logits reach the Gumbel kernel unedited, or penalised only (the FULL decode graph's stages): its
        # vocab-split pass checks them for NaN/inf too. Penalties keep NaN/inf non-finite and finite logits finite,
        # short of overflowing one past 3.4e38 (docs/DECISIONS.md).
        if batch.use_penalties:
            apply_penalties(logits, idx, _penalty_counts(state), use_triton)
        sampled, nonfinite = gumbel_split.sample_split_triton(logits, idx, state.temperature, state.seeds,
                                                              state.num_tokens)
        # Unedited logits are both the raw and the processed ones (greedy rows are not divided by temperature).
        logprobs = compute_logprobs(logits, sampled, batch.num_logprobs, use_triton) if batch.num_logprobs >= 0 else None
        return SamplerOutput(sampled, nonfinite, logprobs)
    nonfinite = ~torch.isfinite(logits).all(dim=-1)
    raw = logits.clone() if raw_logprobs else None
    if batch.allowed is not None:
        apply_allowed_tokens(logits, batch.allowed)
    if batch.sparse is not None:
        apply_sparse_edits(logits, batch.sparse)
    if batch.bad_words is not None:
        apply_bad_word_prefixes(logits, batch.bad_words, state.token_ids, state.prompt_len, state.num_tokens)
    if batch.use_penalties:
        apply_penalties(logits, idx, _penalty_counts(state), use_triton)
    processed_logprobs = batch.num_logprobs >= 0 and raw is None
    if batch.all_greedy or not (batch.use_filters or processed_logprobs):
        # Fast path: the Gumbel kernel applies temperature itself (0 = exact argmax).
        sampled = sample(logits, idx, state.temperature, state.seeds, state.num_tokens, use_triton)
    else:
        temperature = state.temperature.index_select(0, idx)                       # [B]
        greedy = temperature <= 0
        logits.div_(torch.where(greedy, torch.ones_like(temperature), temperature)[:, None])
        if batch.use_filters:
            apply_filters(logits, idx, state.top_k, state.top_p, state.min_p, use_triton)
        direct = torch.arange(idx.shape[0], dtype=torch.int32, device=logits.device)
        sampled = sample(logits, direct, (~greedy).float(), state.seeds.index_select(0, idx),
                         state.num_tokens.index_select(0, idx), use_triton)
    logprobs = None
    if batch.num_logprobs >= 0:
        logprobs = compute_logprobs(raw if raw is not None else logits, sampled, batch.num_logprobs, use_triton)
    return SamplerOutput(sampled, nonfinite, logprobs)
