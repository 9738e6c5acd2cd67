"""State-table updates of speculative decoding, on the device without host syncs: the post-verify update (advance
each row by its accepted count and append its emitted run), the write of freshly proposed drafts into the
history's tail (where the next verify step's prep kernel reads them as input tokens), the model proposers' per
draft-step advance, and the read of a step's drafts back. Each is one Triton kernel of one program per request,
next to its PyTorch reference: the references are ~15-60 small PyTorch kernels each, ~100 of a verify step's
launches (docs/BENCHMARKS.md, sixteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import step_sizes
from graphrunner.penalty_counts import PenaltyCounts, add_output_counts, count_kernel_args


def write_tail(token_ids: Tensor, rows: Tensor, start: Tensor, values: Tensor, count: Tensor) -> None:
    """token_ids[rows[b], start[b] + j] = values[b, j] for j < count[b] (count already fits the row). Columns not
    written are pointed at start - 1 and rewrite their own value there, so no two writes of one row collide with
    different values (an index_put with colliding indices would be nondeterministic). Needs start >= 1 (a row's
    history always holds a token; at start 0 that column would collide with the first write)."""
    if rows.shape[0] == 0 or values.shape[1] == 0:
        return
    j = torch.arange(values.shape[1], device=rows.device)[None, :]  # [1, W] int64
    mask = j < count[:, None]  # [B, W] bool
    # start - 1 is past the row only when nothing of the row is written (count fits): its last column is then safe
    col = torch.where(mask, start[:, None] + j, (start[:, None] - 1).clamp(0, token_ids.shape[1] - 1))  # [B, W] int64
    r = rows[:, None].expand_as(col)
    token_ids[r, col] = torch.where(mask, values.to(token_ids.dtype), token_ids[r, col])


def post_update_spec_ref(
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


def write_drafts_ref(
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


def advance_draft_ref(
    idx_mapping: Tensor,  # [B] int32 (rows may repeat: padding rows of a captured batch)
    step: int,  # i of the k draft steps
    next_step: int,  # the draft step whose inputs are prepared next
    tokens: Tensor,  # [B] int32 / int64: draft i
    token_ids: Tensor,  # [R, L] int32, in place
    num_computed: Tensor,  # [R] int32
    num_tokens: Tensor,  # [R] int32
    positions: Tensor,  # [R] int32, in place: the draft steps' scratch num_computed
    row_num_drafts: Tensor,  # [R] int32, in place
) -> None:
    """After draft i: token_ids[row, num_tokens + i] = tokens[b] where that fits the row, positions[row] =
    num_computed + next_step (the position of the next draft step's token, clamped to the last column: a row at
    max_model_len uses nothing there) and row_num_drafts[row] = the drafts the row holds so far (i + 1, cut to its
    room)."""
    if idx_mapping.shape[0] == 0:
        return
    max_len = token_ids.shape[1]
    rows = idx_mapping.long()  # [B] int64
    nt = num_tokens[rows].long()  # [B] int64
    write_tail(token_ids, rows, nt + step, tokens[:, None], (nt + step < max_len).long())
    positions[rows] = (num_computed[rows] + next_step).clamp(max=max_len - 1)
    row_num_drafts[rows] = (max_len - nt).clamp(0, step + 1).to(torch.int32)


def read_drafts_ref(
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


# ---------------------------------------------------------------------------------------------------------------
# Triton kernels: one program per request (rows are distinct, or padding rows whose programs write equal values).
# ---------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=step_sizes("stride_out", "k1"))
def _post_update_spec_kernel(
    idx_mapping_ptr,  # [B] int32
    num_sched_ptr,  # [B] int32
    num_spec_ptr,  # [B] int32
    out_ptr,  # [B, K + 1] int32
    stride_out,
    num_acc_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    stride_tok,
    num_computed_ptr,  # [R] int32
    num_tokens_ptr,  # [R] int32
    max_len,
    counts_ptr,  # [R, V] int32 output counts (HAS_COUNTS)
    rep_ptr,  # [R] float32
    pres_ptr,  # [R] float32
    freq_ptr,  # [R] float32
    vocab_size,
    k1,  # K + 1
    W_PAD: tl.constexpr,  # a power of two >= K + 1
    HAS_COUNTS: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    acc = tl.load(num_acc_ptr + b)
    nc = tl.load(num_computed_ptr + row) + tl.load(num_sched_ptr + b) - tl.load(num_spec_ptr + b) + acc
    tl.store(num_computed_ptr + row, nc)
    nt = tl.load(num_tokens_ptr + row)
    emit = tl.where(nc >= nt, tl.minimum(acc + 1, tl.maximum(max_len - nt, 0)), 0)
    j = tl.arange(0, W_PAD)
    m = (j < emit) & (j < k1)
    tok = tl.load(out_ptr + b.to(tl.int64) * stride_out + j, mask=m, other=0)
    tl.store(token_ids_ptr + row * stride_tok + nt + j, tok, mask=m)
    tl.store(num_tokens_ptr + row, nt + emit)
    if HAS_COUNTS:  # as state_kernels._post_update_kernel, over the run
        active = (tl.load(rep_ptr + row) != 1.0) | (tl.load(pres_ptr + row) != 0.0) | (tl.load(freq_ptr + row) != 0.0)
        add = tl.where(active, m & (tok >= 0) & (tok < vocab_size), False)
        tl.atomic_add(counts_ptr + row * vocab_size + tok, tl.full((W_PAD,), 1, tl.int32), mask=add, sem="relaxed")


@triton.jit(do_not_specialize=step_sizes("stride_drafts", "k"))
def _write_drafts_kernel(
    idx_mapping_ptr,  # [B] int32
    drafts_ptr,  # [B, k] int32
    stride_drafts,
    num_drafts_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    stride_tok,
    num_tokens_ptr,  # [R] int32
    row_num_drafts_ptr,  # [R] int32
    max_len,
    k,
    K_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    nt = tl.load(num_tokens_ptr + row)
    n = tl.minimum(tl.load(num_drafts_ptr + b), tl.maximum(max_len - nt, 0))
    j = tl.arange(0, K_PAD)
    m = (j < n) & (j < k)
    d = tl.load(drafts_ptr + b.to(tl.int64) * stride_drafts + j, mask=m, other=0)
    tl.store(token_ids_ptr + row * stride_tok + nt + j, d, mask=m)
    tl.store(row_num_drafts_ptr + row, n)


@triton.jit(do_not_specialize=step_sizes("step", "next_step"))
def _advance_draft_kernel(
    idx_mapping_ptr,  # [B] int32
    step,
    next_step,
    tokens_ptr,  # [B] int32 / int64
    token_ids_ptr,  # [R, L] int32
    stride_tok,
    num_computed_ptr,  # [R] int32
    num_tokens_ptr,  # [R] int32
    positions_ptr,  # [R] int32
    row_num_drafts_ptr,  # [R] int32
    max_len,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    nt = tl.load(num_tokens_ptr + row)
    tok = tl.load(tokens_ptr + b).to(tl.int32)
    tl.store(token_ids_ptr + row * stride_tok + nt + step, tok, mask=nt + step < max_len)
    tl.store(positions_ptr + row, tl.minimum(tl.load(num_computed_ptr + row) + next_step, max_len - 1))
    tl.store(row_num_drafts_ptr + row, tl.minimum(tl.maximum(max_len - nt, 0), step + 1))


@triton.jit(do_not_specialize=step_sizes("k"))
def _read_drafts_kernel(
    idx_mapping_ptr,  # [B] int32
    num_spec_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    stride_tok,
    num_tokens_ptr,  # [R] int32
    row_num_drafts_ptr,  # [R] int32
    drafts_ptr,  # [B, K] int32 out
    num_out_ptr,  # [B] int32 out
    max_len,
    k,
    K_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    nt = tl.load(num_tokens_ptr + row)
    j = tl.arange(0, K_PAD)
    col = tl.minimum(nt + j, max_len - 1)
    d = tl.load(token_ids_ptr + row * stride_tok + col, mask=j < k, other=0)
    tl.store(drafts_ptr + b.to(tl.int64) * k + j, d, mask=j < k)
    tl.store(num_out_ptr + b, tl.minimum(tl.load(num_spec_ptr + b), tl.load(row_num_drafts_ptr + row)))


def _pad(n: int) -> int:
    # one compiled variant for every width up to 32 >= MAX_SPEC_TOKENS + 1 (a step's K is the most drafts any of its
    # requests holds, so it varies from step to step: a width-keyed constexpr would compile mid-run)
    return max(32, triton.next_power_of_2(n))


# ---------------------------------------------------------------------------------------------------------------
# Dispatchers: Triton where the runner uses it, the references otherwise.
# ---------------------------------------------------------------------------------------------------------------


def post_update_spec(
    idx_mapping: Tensor, num_scheduled: Tensor, num_spec: Tensor, output_ids: Tensor, num_accepted: Tensor,
    token_ids: Tensor, num_computed: Tensor, num_tokens: Tensor, penalties: PenaltyCounts | None, use_triton: bool,
) -> None:
    """post_update_spec_ref's update (see there), as one Triton launch when use_triton."""
    if not use_triton:
        post_update_spec_ref(idx_mapping, num_scheduled, num_spec, output_ids, num_accepted, token_ids, num_computed,
                             num_tokens, penalties)
        return
    b, k1 = output_ids.shape
    if b == 0:
        return
    output_ids = output_ids.contiguous()  # [B, K + 1] int32
    _post_update_spec_kernel[(b,)](
        idx_mapping.contiguous(), num_scheduled.contiguous(), num_spec.contiguous(), output_ids, output_ids.stride(0),
        num_accepted.contiguous(), token_ids, token_ids.stride(0), num_computed, num_tokens, token_ids.shape[1],
        *count_kernel_args(penalties, num_tokens), k1, W_PAD=_pad(k1), HAS_COUNTS=penalties is not None,
    )


def write_drafts(idx_mapping: Tensor, drafts: Tensor, num_drafts: Tensor, token_ids: Tensor, num_tokens: Tensor,
                 row_num_drafts: Tensor, use_triton: bool) -> None:
    """write_drafts_ref's write (see there), as one Triton launch when use_triton."""
    if not use_triton:
        write_drafts_ref(idx_mapping, drafts, num_drafts, token_ids, num_tokens, row_num_drafts)
        return
    b, k = drafts.shape
    if b == 0:
        return
    drafts = drafts.contiguous()  # [B, k] int32
    _write_drafts_kernel[(b,)](
        idx_mapping.contiguous(), drafts, drafts.stride(0), num_drafts.contiguous(), token_ids, token_ids.stride(0),
        num_tokens, row_num_drafts, token_ids.shape[1], k, K_PAD=_pad(k),
    )


def advance_draft(idx_mapping: Tensor, step: int, next_step: int, tokens: Tensor, token_ids: Tensor,
                  num_computed: Tensor, num_tokens: Tensor, positions: Tensor, row_num_drafts: Tensor,
                  use_triton: bool) -> None:
    """advance_draft_ref's update (see there), as one Triton launch when use_triton (~20 PyTorch kernels per draft
    step otherwise)."""
    if not use_triton:
        advance_draft_ref(idx_mapping, step, next_step, tokens, token_ids, num_computed, num_tokens, positions,
                          row_num_drafts)
        return
    b = idx_mapping.shape[0]
    if b == 0:
        return
    _advance_draft_kernel[(b,)](
        idx_mapping.contiguous(), step, next_step, tokens.contiguous(), token_ids, token_ids.stride(0), num_computed, num_tokens,
        positions, row_num_drafts, token_ids.shape[1],
    )


def read_drafts(idx_mapping: Tensor, num_spec: Tensor, max_spec: int, token_ids: Tensor, num_tokens: Tensor,
                row_num_drafts: Tensor, use_triton: bool) -> tuple[Tensor, Tensor]:
    """read_drafts_ref's read (see there), as one Triton launch when use_triton."""
    b, dev = idx_mapping.shape[0], idx_mapping.device
    if not use_triton or b == 0 or max_spec == 0:  # nothing to launch for the degenerate shapes
        return read_drafts_ref(idx_mapping, num_spec, max_spec, token_ids, num_tokens, row_num_drafts)
    drafts = torch.empty(b, max_spec, dtype=torch.int32, device=dev)  # [B, K] int32
    num = torch.empty(b, dtype=torch.int32, device=dev)  # [B] int32
    _read_drafts_kernel[(b,)](
        idx_mapping.contiguous(), num_spec.contiguous(), token_ids, token_ids.stride(0), num_tokens, row_num_drafts,
        drafts, num, token_ids.shape[1], max_spec, K_PAD=_pad(max_spec),
    )
    return drafts, num
