"""Host side of sampling: per-request data prepared once at admission, and the per-step
SamplingBatch that tells the sampler which stages this batch needs.

Every decision here uses host-known values only (parameters, counts), so a stage no request in
the batch uses is never launched, and nothing waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.host_tensors import to_device
from graphrunner.sampling.masks import AllowedTokens, BadWordPrefixes, SparseEdits
from graphrunner.sampling_params import SamplingParams


@dataclass
class RequestSampling:
    """A request's token-level sampling data, resolved against the tokenizer and vocabulary."""

    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    allowed: list[int] | None = None
    banned: list[int] = field(default_factory=list)             # single-token bad words
    bad_prefixes: list[list[int]] = field(default_factory=list)  # multi-token bad words (prefix + last)
    min_tokens_ban: list[int] = field(default_factory=list)     # stop ids and EOS, banned below min_tokens
    top_k: int | None = None  # params.top_k resolved against the vocabulary (0 = off); None = not resolved


def _check_ids(name: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def prepare_request_sampling(params: SamplingParams, vocab_size: int, eos_ids: tuple[int, ...],
                             tokenizer: Any | None) -> RequestSampling:
    """Validate token ids against the vocabulary, resolve top_k (off when 0, -1 or >= the vocabulary, as vLLM)
    and tokenize bad words (as vLLM: with and without a leading space)."""
    data = RequestSampling(top_k=params.top_k if 0 < params.top_k < vocab_size else 0)
    if params.logit_bias:
        items = [(int(k), float(v)) for k, v in params.logit_bias.items()]  # keys are ints or digit strings
        _check_ids("logit_bias", [k for k, _ in items], vocab_size)
        data.logit_bias = items
    if params.allowed_token_ids is not None:
        _check_ids("allowed_token_ids", list(params.allowed_token_ids), vocab_size)
        data.allowed = sorted(set(params.allowed_token_ids))
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this model has none")
        seqs: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    seqs.add(ids)
        for ids in sorted(seqs):
            _check_ids("bad_words", list(ids), vocab_size)
            (data.banned.append(ids[0]) if len(ids) == 1 else data.bad_prefixes.append(list(ids)))
    _check_ids("stop_token_ids", list(params.stop_token_ids or []), vocab_size)
    if params.min_tokens:
        data.min_tokens_ban = sorted(set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(eos_ids)))
    return data


@dataclass
class SamplingBatch:
    """What the sampler must do for one step's batch."""

    idx_mapping: torch.Tensor                 # [B] int32
    all_greedy: bool
    use_penalties: bool
    use_filters: bool
    num_logprobs: int                         # max logprobs requested in the batch; -1 = none
    sparse: SparseEdits | None = None
    allowed: AllowedTokens | None = None
    bad_words: BadWordPrefixes | None = None

    def full_graph_ok(self, penalties_in_graph: bool) -> bool:
        """The FULL decode graph's sampling covers this batch: plain, or plain but for penalties when the graph
        applies them (rows without penalties pass through it untouched)."""
        if self.plain:
            return True
        return (penalties_in_graph and self.sparse is None and self.allowed is None and self.bad_words is None
                and (self.all_greedy or not self.use_filters) and self.num_logprobs < 0)

    @property
    def plain(self) -> bool:
        """Only temperature/argmax sampling is needed: the stage a FULL decode graph contains."""
        return (self.sparse is None and self.allowed is None and self.bad_words is None and not self.use_penalties
                and (self.all_greedy or not self.use_filters) and self.num_logprobs < 0)


@dataclass
class SampleEntry:
    """One scheduled request as the sampler sees it."""

    row: int
    params: SamplingParams
    data: RequestSampling
    num_generated: int  # output tokens before the one sampled this step


def _uses_filters(e: SampleEntry) -> bool:
    p = e.params
    top_k = p.top_k if e.data.top_k is None else e.data.top_k
    return p.temperature > 0 and (top_k > 0 or p.top_p < 1.0 or p.min_p > 0)


def build_sampling_batch(entries: list[SampleEntry], idx_mapping: torch.Tensor,
                         device: torch.device) -> SamplingBatch:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    allowed_rows: list[int] = []
    allowed_local: list[int] = []
    allowed_cols: list[int] = []
    bad: list[tuple[int, int, list[int]]] = []
    for b, e in enumerate(entries):
        edits = list(e.data.logit_bias) + [(t, float("-inf")) for t in e.data.banned]
        if e.num_generated < e.params.min_tokens:
            edits += [(t, float("-inf")) for t in e.data.min_tokens_ban]
        for tok, value in edits:
            rows.append(b)
            cols.append(tok)
            vals.append(value)
        if e.data.allowed is not None:
            allowed_local += [len(allowed_rows)] * len(e.data.allowed)
            allowed_cols += e.data.allowed
            allowed_rows.append(b)
        bad += [(b, e.row, seq) for seq in e.data.bad_prefixes]
    params = [e.params for e in entries]
    batch = SamplingBatch(
        idx_mapping=idx_mapping,
        all_greedy=all(p.temperature == 0.0 for p in params),
        use_penalties=any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params),
        use_filters=any(_uses_filters(e) for e in entries),
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
    )
    if rows:
        batch.sparse = SparseEdits(to_device(rows, torch.int64, device), to_device(cols, torch.int64, device),
                                   to_device(vals, torch.float32, device))
    if allowed_rows:
        batch.allowed = AllowedTokens(to_device(allowed_rows, torch.int64, device),
                                      to_device(allowed_local, torch.int64, device),
                                      to_device(allowed_cols, torch.int64, device))
    if bad:
        width = max(len(seq) - 1 for _, _, seq in bad)
        prefix = [seq[:-1] + [0] * (width - len(seq) + 1) for _, _, seq in bad]
        batch.bad_words = BadWordPrefixes(
            rows=to_device([b for b, _, _ in bad], torch.int64, device),
            state_rows=to_device([r for _, r, _ in bad], torch.int64, device),
            prefix=to_device(prefix, torch.int32, device),
            prefix_len=to_device([len(seq) - 1 for _, _, seq in bad], torch.int64, device),
            last=to_device([seq[-1] for _, _, seq in bad], torch.int64, device),
        )
    return batch
