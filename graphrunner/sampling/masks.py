"""Sparse logit edits prepared on the host: logit_bias, min_tokens / single-token bad-word bans,
allowed_token_ids whitelists, and multi-token bad words checked against the device token history.

All of these are plain PyTorch ops (index_put_ / index_add_ / gather) with host-known sizes: no
host synchronisation, and nothing runs when no request in the batch uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseEdits:
    """logits[rows[i], cols[i]] += values[i] (values may be -inf to ban a token)."""

    rows: torch.Tensor    # [N] int64 batch row
    cols: torch.Tensor    # [N] int64 token id
    values: torch.Tensor  # [N] float32


@dataclass
class AllowedTokens:
    """Batch rows `rows` keep only their listed tokens; entry j allows token cols[j] in rows[local[j]]."""

    rows: torch.Tensor   # [Na] int64 batch rows with a whitelist
    local: torch.Tensor  # [M] int64 index into rows
    cols: torch.Tensor   # [M] int64 allowed token ids


@dataclass
class BadWordPrefixes:
    """Ban last[e] in batch row rows[e] when the output ends with prefix[e, :prefix_len[e]]."""

    rows: torch.Tensor        # [E] int64 batch row
    state_rows: torch.Tensor  # [E] int64 state-table row of that batch row
    prefix: torch.Tensor      # [E, P] int32, left-aligned, padded with 0
    prefix_len: torch.Tensor  # [E] int64, >= 1
    last: torch.Tensor        # [E] int64 token to ban


def apply_sparse_edits(logits: torch.Tensor, edits: SparseEdits) -> None:
    """logits [B, V] float32, in place; repeated (row, col) pairs add up."""
    logits.index_put_((edits.rows, edits.cols), edits.values, accumulate=True)


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Every token not on its row's whitelist becomes -inf (in place)."""
    mask = torch.full((allowed.rows.shape[0], logits.shape[1]), float("-inf"), device=logits.device)
    # a device-side value tensor: a Python scalar here would be copied from the host synchronously
    mask.index_put_((allowed.local, allowed.cols), torch.zeros_like(allowed.cols, dtype=mask.dtype))
    logits.index_add_(0, allowed.rows, mask)


def apply_bad_word_prefixes(logits: torch.Tensor, bad: BadWordPrefixes, token_ids: torch.Tensor,
                            prompt_len: torch.Tensor, num_tokens: torch.Tensor) -> None:
    """Compare each prefix with the tail of the row's generated tokens (on the device) and ban its last token."""
    width = bad.prefix.shape[1]
    n = num_tokens.index_select(0, bad.state_rows).long()                        # [E]
    j = torch.arange(width, device=logits.device)
    pos = n[:, None] - bad.prefix_len[:, None] + j[None, :]                       # [E, P]
    in_prefix = j[None, :] < bad.prefix_len[:, None]
    hist = token_ids[bad.state_rows[:, None], pos.clamp(min=0, max=token_ids.shape[1] - 1)]
    same = (hist == bad.prefix) | ~in_prefix
    generated = n - prompt_len.index_select(0, bad.state_rows).long()
    match = same.all(dim=1) & (generated >= bad.prefix_len)                       # [E]
    ban = torch.where(match, torch.full_like(match, float("-inf"), dtype=logits.dtype),
                      torch.zeros_like(match, dtype=logits.dtype))
    logits.index_put_((bad.rows, bad.last), ban, accumulate=True)
