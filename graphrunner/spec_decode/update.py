"""State-table updates of speculative decoding, on the device without host syncs: the post-verify update (advance
each row by its accepted count and append its emitted run) and the write of freshly proposed drafts into the
history's tail, where the next verify step's prep kernel reads them as input tokens.

Plain PyTorch (a few gathers and index_puts over [B, K + 1]); no Triton kernel, so no reference to compare.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphrunner.penalty_counts import PenaltyCounts, add_output_counts


def write_tail(token_ids: Tensor, rows: Tensor, start: Tensor, values: Tensor, count: Tensor) -> None:
    """token_ids[rows[b], start[b] + j] = values[b, j] for j < count[b] (count already fits the row). Columns not
    written are pointed at start - 1 and rewrite their own value there, so no two writes of one row collide with
    different values (an index_put with colliding indices would be nondeterministic)."""
    if rows.shape[0] == 0 or values.shape[1] == 0:
        return
    j = torch.arange(values.shape[1], device=rows.device)[None, :]  # [1, W] int64
    mask = j < count[:, None]  # [B, W] bool
    col = torch.where(mask, start[:, None] + j, (start[:, None] - 1).clamp(min=0))  # [B, W] int64
    r = rows[:, None].expand_as(col)
    token_ids[r, col] = torch.where(mask, values.to(token_ids.dtype), token_ids[r, col])


def post_update_spec(
    idx_mapping: Tensor,  # [B] int32, distinct rows
    num_scheduled: Tensor,  # [B] int32
    num_spec: Tensor,  # [B] int32 draft slots of the step (0: a plain prefill chunk or decode)
    output_ids: Tensor,  # [B, K + 1] int32: accepted drafts, then the corrected / bonus token; -1 unused
    num_accepted: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32, in place
    num_computed: Tensor,  # [R] int32, in place
    num_tokens: Tensor,  # [R] int32, in place
    penalties: PenaltyCounts | None = None,  # output counts, in place
) -> None:
    """num_computed[row] += num_scheduled - num_spec + num_accepted (the rejected drafts' KV is garbage, later
    overwritten); when that reaches num_tokens[row] (the step ended on the row's last known token) the emitted run
    output_ids[b, :num_accepted + 1] is appended to the history (as far as the row has room), and counted in the
    penalty statistics of rows that use a penalty."""
    if idx_mapping.shape[0] == 0:
        return
    rows = idx_mapping.long()  # [B] int64
    nc = num_computed[rows] + num_scheduled - num_spec + num_accepted  # [B] int32
    num_computed[rows] = nc
    nt = num_tokens[rows].long()  # [B] int64
    room = (token_ids.shape[1] - nt).clamp(min=0)
    emit = torch.where(nc >= nt, num_accepted.long() + 1, 0).minimum(room)  # [B] int64
    write_tail(token_ids, rows, nt, output_ids, emit)
    num_tokens[rows] = (nt + emit).to(torch.int32)
    if penalties is not None:
        add_output_counts(idx_mapping, output_ids, emit, penalties)


def write_drafts(
    idx_mapping: Tensor,  # [B] int32 (rows may repeat: padding rows of a captured batch)
    drafts: Tensor,  # [B, k] int32
    num_drafts: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32, in place
    num_tokens: Tensor,  # [R] int32
    row_num_drafts: Tensor,  # [R] int32, in place: the state table's draft count per row
) -> None:
    """token_ids[row, num_tokens : num_tokens + n] = drafts[b, :n] with n = num_drafts[b] cut to the row's room;
    row_num_drafts[row] = n."""
    if idx_mapping.shape[0] == 0:
        return
    rows = idx_mapping.long()  # [B] int64
    nt = num_tokens[rows].long()  # [B] int64
    n = num_drafts.long().minimum((token_ids.shape[1] - nt).clamp(min=0))  # [B] int64
    write_tail(token_ids, rows, nt, drafts, n)
    row_num_drafts[rows] = n.to(torch.int32)


def read_drafts(
    idx_mapping: Tensor,  # [B] int32
    num_spec: Tensor,  # [B] int32 draft slots scheduled this step
    max_spec: int,  # K
    token_ids: Tensor,  # [R, L] int32
    num_tokens: Tensor,  # [R] int32 (before this step's post-update)
    row_num_drafts: Tensor,  # [R] int32
) -> tuple[Tensor, Tensor]:
    """(drafts [B, K] int32, drafts to verify [B] int32 = min(num_spec, proposed)) of this step's requests."""
    rows = idx_mapping.long()
    nt = num_tokens[rows].long()  # [B] int64
    j = torch.arange(max_spec, device=rows.device)[None, :]
    col = (nt[:, None] + j).clamp(max=token_ids.shape[1] - 1)  # [B, K] int64
    drafts = token_ids[rows[:, None].expand_as(col), col]  # [B, K] int32
    return drafts, torch.minimum(num_spec, row_num_drafts[rows])
