"""The sampler of a verify step: the per-position sampling stages over every logits row (per-request parameters
read through the expanded idx_mapping), then the device rejection sampler, then logprobs per emitted token.

The stages and their order are run_sampler's; the final Gumbel-max is replaced by rejection_sample, whose RNG key
of row j of request b is (seed, num_tokens[row] + j): the position of the token that row emits, so seeded
requests draw the same noise whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner.sampling.batch import SamplingBatch
from graphrunner.sampling.filters import apply_filters
from graphrunner.sampling.logprobs import LogprobsTensors, compute_logprobs
from graphrunner.sampling.masks import apply_allowed_tokens, apply_bad_word_prefixes, apply_sparse_edits
from graphrunner.sampling.penalties import apply_penalties
from graphrunner.sampling.rejection_split import rejection_sample
from graphrunner.spec_decode.layout import SpecLayout
from graphrunner.spec_decode.update import read_drafts
from graphrunner.state_table import StateTable


@dataclass
class VerifyOutput:
    output_ids: torch.Tensor          # [B, K + 1] int32: accepted drafts, then the corrected / bonus token; -1 unused
    num_accepted: torch.Tensor        # [B] int32
    num_drafts: torch.Tensor          # [B] int32 drafts verified
    nonfinite: torch.Tensor           # [B] bool: a row whose token was emitted held NaN / inf logits
    logprobs: LogprobsTensors | None  # [N, ...] per logits row, for the token that row emitted


def verify_sample(logits: torch.Tensor, batch: SamplingBatch, layout: SpecLayout, idx_mapping: torch.Tensor,
                  state: StateTable, use_triton: bool, logprobs_mode: str = "raw_logprobs") -> VerifyOutput:
    """logits [N, V] float32 (modified in place); `batch` was built over the N logits rows (one entry per row, its
    idx_mapping = layout.expanded_idx); idx_mapping [B] int32 are the requests' rows."""
    idx = batch.idx_mapping  # [N] int32
    nonfinite_rows = ~torch.isfinite(logits).all(dim=-1)  # [N] bool
    raw = logits.clone() if batch.num_logprobs >= 0 and logprobs_mode == "raw_logprobs" else None
    if batch.allowed is not None:
        apply_allowed_tokens(logits, batch.allowed)
    if batch.sparse is not None:
        apply_sparse_edits(logits, batch.sparse)
    if batch.bad_words is not None:
        apply_bad_word_prefixes(logits, batch.bad_words, state.token_ids, state.prompt_len, state.num_tokens)
    if batch.use_penalties:  # only requests without drafts use penalties: their one row sees the exact history
        if state.penalties is None:
            raise ValueError("a batch with penalties needs the state table's penalty statistics")
        apply_penalties(logits, idx, state.penalties, use_triton)
    rows = idx_mapping.long()  # [B] int64
    temperature = state.temperature.index_select(0, rows)  # [B] float32
    if not batch.all_greedy and (batch.use_filters or (batch.num_logprobs >= 0 and raw is None)):
        # filters need the tempered logits: divide here, and let the rejection kernel see temperature 1 (0: greedy)
        t_rows = state.temperature.index_select(0, idx)  # [N] float32
        logits.div_(torch.where(t_rows <= 0, torch.ones_like(t_rows), t_rows)[:, None])
        if batch.use_filters:
            apply_filters(logits, idx, state.top_k, state.top_p, state.min_p, use_triton)
        temperature = (temperature > 0).float()
    drafts, num_drafts = read_drafts(idx_mapping, layout.num_spec, layout.max_spec, state.token_ids, state.num_tokens,
                                     state.num_drafts, use_triton)
    positions = state.num_tokens.index_select(0, rows).long()  # [B] int64: position of each request's first token
    out, num_accepted = rejection_sample(logits, layout.cu_num_logits, drafts, num_drafts, None, temperature,
                                         state.seeds.index_select(0, rows), positions, use_triton)
    emitted = layout.row_j <= num_accepted.long().index_select(0, layout.row_req)  # [N] bool
    nonfinite = torch.zeros(layout.num_reqs, dtype=torch.int32, device=logits.device)
    nonfinite.index_add_(0, layout.row_req, (nonfinite_rows & emitted).int())
    logprobs = None
    if batch.num_logprobs >= 0:
        k1 = out.shape[1]
        row_tok = out.view(-1).index_select(0, layout.row_req * k1 + layout.row_j).clamp(min=0)  # [N] int32
        logprobs = compute_logprobs(raw if raw is not None else logits, row_tok, batch.num_logprobs, use_triton)
    return VerifyOutput(out, num_accepted, num_drafts, nonfinite > 0, logprobs)
