"""Device-side updates of the persistent state table: staged ragged row writes and the post-sample update.

Each operation has a Triton kernel, a PyTorch reference (`*_ref`) and a dispatcher taking `use_triton`;
none of them synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor as _check
from graphrunner.penalty_counts import PenaltyCounts, count_kernel_args

_BLOCK = 256  # values written per loop iteration of one ragged-write program




# ---------------------------------------------------------------------------------------------------------------
# apply_ragged_writes: dst[rows[n], starts[n] : starts[n] + len_n] = values[cu_lens[n] : cu_lens[n + 1]]
# ---------------------------------------------------------------------------------------------------------------


def _check_ragged(dst: Tensor, rows: Tensor, starts: Tensor, cu_lens: Tensor, values: Tensor) -> None:
    dev = dst.device
    _check(dst, "dst", None, 2, dev)
    _check(rows, "rows", torch.int32, 1, dev)
    _check(starts, "starts", torch.int32, 1, dev)
    _check(cu_lens, "cu_lens", torch.int32, 1, dev)
    _check(values, "values", dst.dtype, 1, dev)
    n = rows.shape[0]
    if starts.shape[0] != n:
        raise ValueError(f"starts has {starts.shape[0]} entries, rows has {n}")
    if cu_lens.shape[0] != n + 1:
        raise ValueError(f"cu_lens must have len(rows) + 1 = {n + 1} entries, got {cu_lens.shape[0]}")
    if dst.stride(1) != 1:
        raise ValueError("dst must have unit stride along its last dimension")


def apply_ragged_writes_ref(
    dst: Tensor,  # [R, L] int32 (any dtype equal to values'), written in place
    rows: Tensor,  # [N] int32
    starts: Tensor,  # [N] int32
    cu_lens: Tensor,  # [N + 1] int32
    values: Tensor,  # [total] int32, total == cu_lens[N]
) -> None:
    """PyTorch reference: one index_put over all `total` values (the write of each value is found by searchsorted)."""
    _check_ragged(dst, rows, starts, cu_lens, values)
    total = values.shape[0]
    if rows.shape[0] == 0 or total == 0:
        return
    j = torch.arange(total, dtype=torch.int64, device=dst.device)  # [total] int64
    n = torch.searchsorted(cu_lens[1:].long(), j, right=True)  # [total] int64, write of each value
    cols = starts[n].long() + (j - cu_lens[n].long())  # [total] int64
    dst.index_put_((rows[n].long(), cols), values)


@triton.jit
def _apply_ragged_writes_kernel(
    dst_ptr,  # [R, L]
    dst_stride,
    rows_ptr,  # [N] int32
    starts_ptr,  # [N] int32
    cu_lens_ptr,  # [N + 1] int32
    values_ptr,  # [total]
    BLOCK: tl.constexpr,
):
    ragged_write_one(dst_ptr, dst_stride, rows_ptr, starts_ptr, cu_lens_ptr, values_ptr, tl.program_id(0), BLOCK)


@triton.jit
def ragged_write_one(dst_ptr, dst_stride, rows_ptr, starts_ptr, cu_lens_ptr, values_ptr, w, BLOCK: tl.constexpr):
    """Write number w of a ragged set: dst[rows[w], starts[w]:] = values[cu_lens[w] : cu_lens[w + 1]]."""
    offs = tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + w).to(tl.int64)
    start = tl.load(starts_ptr + w).to(tl.int64)
    lo = tl.load(cu_lens_ptr + w)
    length = tl.load(cu_lens_ptr + w + 1) - lo
    src = values_ptr + lo.to(tl.int64)
    out = dst_ptr + row * dst_stride + start
    for i in range(0, length, BLOCK):
        j = i + offs
        m = j < length
        tl.store(out + j, tl.load(src + j, mask=m), mask=m)


def apply_ragged_writes_triton(dst: Tensor, rows: Tensor, starts: Tensor, cu_lens: Tensor, values: Tensor) -> None:
    """Triton version: one program per write. Reads only values[cu_lens[0] : cu_lens[N]]."""
    _check_ragged(dst, rows, starts, cu_lens, values)
    num_writes = rows.shape[0]
    if num_writes == 0:
        return
    _apply_ragged_writes_kernel[(num_writes,)](
        dst, dst.stride(0), rows.contiguous(), starts.contiguous(), cu_lens.contiguous(), values.contiguous(),
        BLOCK=_BLOCK,
    )


def apply_ragged_writes(
    dst: Tensor,  # [R, L] int32, written in place
    rows: Tensor,  # [N] int32
    starts: Tensor,  # [N] int32 first column to write
    cu_lens: Tensor,  # [N + 1] int32 offsets into values
    values: Tensor,  # [total] int32
    use_triton: bool,
) -> None:
    """dst[rows[n], starts[n] : starts[n] + len_n] = values[cu_lens[n] : cu_lens[n + 1]] for every n.

    Preconditions (unchecked, checking would sync): cu_lens non-decreasing with cu_lens[N] == len(values)
    (the reference needs it; Triton ignores any tail), every write inside its row, no two writes overlap.
    dst may have any dtype as long as values has the same one.
    """
    fn = apply_ragged_writes_triton if use_triton else apply_ragged_writes_ref
    fn(dst, rows, starts, cu_lens, values)


# ---------------------------------------------------------------------------------------------------------------
# post_update: advance num_computed and append the sampled token to the history when the step reached its end
# ---------------------------------------------------------------------------------------------------------------


def _check_post(
    idx_mapping: Tensor, num_scheduled: Tensor, sampled: Tensor, token_ids: Tensor, num_computed: Tensor,
    num_tokens: Tensor, penalties: PenaltyCounts | None = None,
) -> None:
    dev = idx_mapping.device
    _check(idx_mapping, "idx_mapping", torch.int32, 1, dev)
    _check(num_scheduled, "num_scheduled", torch.int32, 1, dev)
    _check(sampled, "sampled", torch.int32, 1, dev)
    _check(token_ids, "token_ids", torch.int32, 2, dev)
    _check(num_computed, "num_computed", torch.int32, 1, dev)
    _check(num_tokens, "num_tokens", torch.int32, 1, dev)
    b = idx_mapping.shape[0]
    if num_scheduled.shape[0] != b or sampled.shape[0] != b:
        raise ValueError(
            f"idx_mapping ({b}), num_scheduled ({num_scheduled.shape[0]}) and sampled ({sampled.shape[0]}) "
            "must have the same length"
        )
    r = token_ids.shape[0]
    if num_computed.shape[0] != r or num_tokens.shape[0] != r:
        raise ValueError(
            f"row counts differ: token_ids {r}, num_computed {num_computed.shape[0]}, num_tokens {num_tokens.shape[0]}"
        )
    if token_ids.stride(1) != 1:
        raise ValueError("token_ids must have unit stride along its last dimension")
    if not (num_computed.is_contiguous() and num_tokens.is_contiguous()):
        raise ValueError("num_computed and num_tokens must be contiguous (they are updated in place)")
    if penalties is not None:
        _check(penalties.output_counts, "output_counts", torch.int32, 2, dev)
        if penalties.output_counts.shape[0] != r or not penalties.output_counts.is_contiguous():
            raise ValueError(f"output_counts must be a contiguous [{r}, V] tensor, got "
                             f"{tuple(penalties.output_counts.shape)}")
        for t, name in ((penalties.repetition, "repetition"), (penalties.presence, "presence"),
                        (penalties.frequency, "frequency")):
            _check(t, name, torch.float32, 1, dev)
            if t.shape[0] != r:
                raise ValueError(f"{name} has {t.shape[0]} entries, token_ids has {r} rows")


def post_update_ref(
    idx_mapping: Tensor,  # [B] int32
    num_scheduled: Tensor,  # [B] int32
    sampled: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32, in place
    num_computed: Tensor,  # [R] int32, in place
    num_tokens: Tensor,  # [R] int32, in place
    penalties: PenaltyCounts | None = None,  # output counts in place
) -> None:
    """PyTorch reference of post_update (rows in idx_mapping are distinct)."""
    _check_post(idx_mapping, num_scheduled, sampled, token_ids, num_computed, num_tokens, penalties)
    max_len = token_ids.shape[1]
    if idx_mapping.shape[0] == 0:
        return
    rows = idx_mapping.long()  # [B] int64
    nc = num_computed[rows] + num_scheduled  # [B] int32
    num_computed[rows] = nc
    nt = num_tokens[rows]  # [B] int32
    append = (nc >= nt) & (nt < max_len)  # [B] bool
    if max_len > 0:
        col = nt.long().clamp(max=max_len - 1)  # [B] int64; rows that do not append rewrite their old value
        token_ids[rows, col] = torch.where(append, sampled, token_ids[rows, col])
    num_tokens[rows] = nt + append.to(torch.int32)
    if penalties is not None:
        vocab = penalties.vocab_size
        active = ((penalties.repetition[rows] != 1.0) | (penalties.presence[rows] != 0.0)
                  | (penalties.frequency[rows] != 0.0))  # [B] bool
        add = append & active & (sampled >= 0) & (sampled < vocab)  # [B] bool
        penalties.output_counts.index_put_((rows, sampled.long().clamp(0, vocab - 1)), add.to(torch.int32),
                                           accumulate=True)


@triton.jit
def _post_update_kernel(
    idx_mapping_ptr,  # [B] int32
    num_sched_ptr,  # [B] int32
    sampled_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    token_ids_stride,
    num_computed_ptr,  # [R] int32
    num_tokens_ptr,  # [R] int32
    max_len,
    counts_ptr,  # [R, V] int32 output counts (HAS_COUNTS)
    rep_ptr,  # [R] float32
    pres_ptr,  # [R] float32
    freq_ptr,  # [R] float32
    vocab_size,
    HAS_COUNTS: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
    nc = tl.load(num_computed_ptr + row) + tl.load(num_sched_ptr + pid)
    tl.store(num_computed_ptr + row, nc)
    nt = tl.load(num_tokens_ptr + row)
    append = (nc >= nt) & (nt < max_len)
    tok = tl.load(sampled_ptr + pid)
    tl.store(token_ids_ptr + row * token_ids_stride + nt, tok, mask=append)
    tl.store(num_tokens_ptr + row, nt + append.to(tl.int32))
    if HAS_COUNTS:
        active = (tl.load(rep_ptr + row) != 1.0) | (tl.load(pres_ptr + row) != 0.0) | (tl.load(freq_ptr + row) != 0.0)
        add = append & active & (tok >= 0) & (tok < vocab_size)
        tl.atomic_add(counts_ptr + row * vocab_size + tok, 1, mask=add, sem="relaxed")


def post_update_triton(
    idx_mapping: Tensor, num_scheduled: Tensor, sampled: Tensor, token_ids: Tensor, num_computed: Tensor,
    num_tokens: Tensor, penalties: PenaltyCounts | None = None,
) -> None:
    """Triton version of post_update: one program per request (the output-count update fused in)."""
    _check_post(idx_mapping, num_scheduled, sampled, token_ids, num_computed, num_tokens, penalties)
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    _post_update_kernel[(num_reqs,)](
        idx_mapping.contiguous(), num_scheduled.contiguous(), sampled.contiguous(), token_ids, token_ids.stride(0),
        num_computed, num_tokens, token_ids.shape[1], *count_kernel_args(penalties, num_tokens),
        HAS_COUNTS=penalties is not None,
    )


def post_update(
    idx_mapping: Tensor,  # [B] int32
    num_scheduled: Tensor,  # [B] int32
    sampled: Tensor,  # [B] int32 token sampled for each request
    token_ids: Tensor,  # [R, L] int32, in place
    num_computed: Tensor,  # [R] int32, in place
    num_tokens: Tensor,  # [R] int32, in place
    use_triton: bool,
    penalties: PenaltyCounts | None = None,  # output counts, in place
) -> None:
    """For each b (distinct rows): num_computed[row] += num_scheduled[b]; if that reaches num_tokens[row] (the
    step ended on the last known token, so sampled[b] is a real new token) and the row has room, append
    sampled[b] to token_ids[row] and bump num_tokens[row]. A partial prefill chunk leaves the history alone.
    With `penalties`, an appended token of a row that uses a penalty also counts in its output counts (ids
    outside [0, V) are not counted), so the counts follow the history exactly."""
    fn = post_update_triton if use_triton else post_update_ref
    fn(idx_mapping, num_scheduled, sampled, token_ids, num_computed, num_tokens, penalties)
