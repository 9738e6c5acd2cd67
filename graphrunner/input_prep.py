"""Device-side preparation of one step's inputs from the persistent state table.

Builds input_ids, positions, query_start_loc, seq_lens, slot_mapping, the gathered block table and
logits_indices without any host synchronisation: a Triton kernel (one launch) and a PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.host_tensors import host_tensor
from graphrunner.kernel_checks import check_tensor as _check
from graphrunner.kernel_checks import int32_aligned, step_sizes

_BLOCK = 128  # tokens / block-table columns handled per loop iteration of one program


@dataclass
class StepInputs:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    slot_mapping: Tensor  # [T] int64, -1 for padding tokens
    block_table: Tensor  # [B, num_block_cols] int32, rows of the persistent table gathered by idx_mapping
    logits_indices: Tensor  # [B] int64, index of each request's last scheduled token


class StepBuffers:
    """Persistent step-input tensors at their largest sizes; each step writes views of them, so a
    captured CUDA graph (and the model's first compiled piece) always reads the same addresses.

    `step_rows` holds a step's (padded) state-table rows, then its per-row token counts: the host
    ships both in one H2D copy, and a FULL graph reads them at a fixed address. The counts start at a
    multiple of 4 entries (16 bytes): Triton specialises kernels on pointer alignment, so a view whose
    alignment followed the batch size would compile new kernel variants in the middle of serving."""

    def __init__(self, max_reqs: int, max_tokens: int, max_block_cols: int, device: torch.device,
                 padding_row: int | None = None) -> None:
        i32, i64 = {"dtype": torch.int32, "device": device}, {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_tokens, **i64)             # [T_max] int64
        self.positions = torch.zeros(max_tokens, **i64)             # [T_max] int64
        self.query_start_loc = torch.zeros(max_reqs + 1, **i32)     # [B_max + 1] int32
        self.seq_lens = torch.zeros(max_reqs, **i32)                # [B_max] int32
        self.slot_mapping = torch.full((max_tokens,), -1, **i64)    # [T_max] int64
        self.block_table = torch.zeros(max_reqs * max_block_cols, **i32)  # [B_max * C_max] int32, viewed [B, C]
        self.logits_indices = torch.zeros(max_reqs, **i64)          # [B_max] int64
        self.step_rows = torch.zeros(2 * max_reqs + 4, **i32)       # [2 * B_max + 4] int32: rows, then counts
        self.max_block_cols = max_block_cols
        self.padding_row = max_reqs if padding_row is None else padding_row  # a state row no request owns

    def views(self, num_reqs: int, num_tokens: int, num_block_cols: int) -> StepInputs:
        if num_tokens > self.input_ids.shape[0] or num_reqs > self.seq_lens.shape[0]:
            raise ValueError(f"a step of {num_reqs} requests / {num_tokens} tokens exceeds the step buffers "
                             f"({self.seq_lens.shape[0]} / {self.input_ids.shape[0]})")
        return StepInputs(self.input_ids[:num_tokens], self.positions[:num_tokens],
                          self.query_start_loc[:num_reqs + 1], self.seq_lens[:num_reqs],
                          self.slot_mapping[:num_tokens],
                          self.block_table[:num_reqs * num_block_cols].view(num_reqs, num_block_cols),
                          self.logits_indices[:num_reqs])

    @staticmethod
    def counts_offset(padded: int) -> int:
        """Where a step of `padded` rows keeps its token counts in step_rows: the first 16-byte boundary after
        its rows."""
        return int32_aligned(padded)

    def rows(self, num_reqs: int, padded: int) -> tuple[Tensor, Tensor]:
        """(idx_mapping [num_reqs] int32, num_scheduled [num_reqs] int32) of a step padded to `padded` rows."""
        off = self.counts_offset(padded)
        return self.step_rows[:num_reqs], self.step_rows[off:off + num_reqs]

    def stage_rows(self, rows: list[int], counts: list[int], padded: int) -> Tensor:
        """The host image of step_rows[:counts_offset(padded) + padded] for a step: rows, then the padding row up
        to `padded`, zeros up to the counts' offset, the counts, zeros for the padding rows."""
        pad, off = padded - len(rows), self.counts_offset(padded)
        return host_tensor(rows + [self.padding_row] * pad + [0] * (off - padded) + counts + [0] * pad, torch.int32)

    def fill_padding_rows(self, num_reqs: int) -> None:
        """Point the first num_reqs step rows at the padding row with 0 tokens (capture's dummy batch)."""
        off = self.counts_offset(num_reqs)
        self.step_rows[:num_reqs].fill_(self.padding_row)
        self.step_rows[off:off + num_reqs].zero_()


def _check_args(
    idx_mapping: Tensor,
    num_scheduled: Tensor,
    token_ids: Tensor,
    num_computed: Tensor,
    block_table: Tensor,
    block_size: int,
    num_tokens: int,
    num_block_cols: int,
) -> None:
    dev = idx_mapping.device
    _check(idx_mapping, "idx_mapping", torch.int32, 1, dev)
    _check(num_scheduled, "num_scheduled", torch.int32, 1, dev)
    _check(token_ids, "token_ids", torch.int32, 2, dev)
    _check(num_computed, "num_computed", torch.int32, 1, dev)
    _check(block_table, "block_table", torch.int32, 2, dev)
    if num_scheduled.shape != idx_mapping.shape:
        raise ValueError(f"num_scheduled shape {tuple(num_scheduled.shape)} != idx_mapping {tuple(idx_mapping.shape)}")
    num_rows = token_ids.shape[0]
    if num_computed.shape[0] != num_rows or block_table.shape[0] != num_rows:
        raise ValueError(
            f"row counts differ: token_ids {num_rows}, num_computed {num_computed.shape[0]}, "
            f"block_table {block_table.shape[0]}"
        )
    if token_ids.stride(1) != 1 or block_table.stride(1) != 1:
        raise ValueError("token_ids and block_table must have unit stride along their last dimension")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    if not isinstance(num_block_cols, int) or not 0 <= num_block_cols <= block_table.shape[1]:
        raise ValueError(f"num_block_cols must be an int in [0, {block_table.shape[1]}], got {num_block_cols!r}")


def prepare_inputs_ref(
    idx_mapping: Tensor,  # [B] int32
    num_scheduled: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32
    num_computed: Tensor,  # [R] int32
    block_table: Tensor,  # [R, M] int32
    block_size: int,
    num_tokens: int,
    num_block_cols: int,
) -> StepInputs:
    """PyTorch reference of prepare_inputs (no host sync: the request of each token comes from searchsorted)."""
    _check_args(idx_mapping, num_scheduled, token_ids, num_computed, block_table, block_size, num_tokens, num_block_cols)
    dev = idx_mapping.device
    num_reqs = idx_mapping.shape[0]
    rows = idx_mapping.long()  # [B] int64
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)  # [B + 1] int32
    torch.cumsum(num_scheduled, dim=0, dtype=torch.int32, out=query_start_loc[1:])
    nc = num_computed[rows]  # [B] int32
    seq_lens = nc + num_scheduled  # [B] int32
    logits_indices = (query_start_loc[1:].long() - 1).clamp(min=0)  # [B] int64; an all-padding batch reads 0
    gathered = block_table[rows, :num_block_cols].contiguous()  # [B, num_block_cols] int32

    tok = torch.arange(num_tokens, dtype=torch.int64, device=dev)  # [T] int64
    if num_reqs == 0:  # shape-based branch: everything is padding
        zeros = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        return StepInputs(zeros, zeros.clone(), query_start_loc, seq_lens, torch.full_like(zeros, -1), gathered,
                          logits_indices)
    ends = query_start_loc[1:].long()  # [B] int64
    req = torch.searchsorted(ends, tok, right=True)  # [T] int64 in [0, B]; B = padding
    valid = req < num_reqs  # [T] bool
    req = req.clamp(max=num_reqs - 1)
    pos = nc[req].long() + (tok - query_start_loc[req].long())  # [T] int64
    pos = torch.where(valid, pos, 0)
    row_t = rows[req]  # [T] int64
    input_ids = torch.where(valid, token_ids[row_t, pos].long(), 0)  # [T] int64
    blk = block_table[row_t, pos // block_size].long()  # [T] int64
    slot_mapping = torch.where(valid, blk * block_size + pos % block_size, -1)  # [T] int64
    return StepInputs(input_ids, pos, query_start_loc, seq_lens, slot_mapping, gathered, logits_indices)


@triton.jit(do_not_specialize=step_sizes("out_bt_stride", "num_reqs", "num_tokens", "num_block_cols"))
def _prepare_inputs_kernel(
    idx_mapping_ptr,  # [B] int32
    num_sched_ptr,  # [B] int32
    token_ids_ptr,  # [R, L] int32
    token_ids_stride,
    num_computed_ptr,  # [R] int32
    block_table_ptr,  # [R, M] int32
    block_table_stride,
    out_ids_ptr,  # [T] int64
    out_pos_ptr,  # [T] int64
    out_qsl_ptr,  # [B + 1] int32
    out_seq_lens_ptr,  # [B] int32
    out_slot_ptr,  # [T] int64
    out_bt_ptr,  # [B, C] int32
    out_bt_stride,
    out_logits_idx_ptr,  # [B] int64
    num_reqs,
    num_tokens,
    num_block_cols,
    block_size,
    BLOCK: tl.constexpr,
):
    # Programs 0..B-1 handle one request each; program B writes query_start_loc[B] and the padding tokens.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, pid, BLOCK):  # start = sum(num_scheduled[:pid])
        acc += tl.load(num_sched_ptr + i + offs, mask=(i + offs) < pid, other=0)
    start = tl.sum(acc, axis=0)
    tl.store(out_qsl_ptr + pid, start)
    if pid == num_reqs:
        for t0 in range(start, num_tokens, BLOCK):
            t = t0 + offs
            m = t < num_tokens
            zero = tl.zeros([BLOCK], dtype=tl.int64)
            tl.store(out_ids_ptr + t, zero, mask=m)
            tl.store(out_pos_ptr + t, zero, mask=m)
            tl.store(out_slot_ptr + t, zero - 1, mask=m)
    else:
        row = tl.load(idx_mapping_ptr + pid).to(tl.int64)
        n = tl.load(num_sched_ptr + pid)
        nc = tl.load(num_computed_ptr + row)
        tl.store(out_seq_lens_ptr + pid, nc + n)
        tl.store(out_logits_idx_ptr + pid, tl.maximum(start + n - 1, 0).to(tl.int64))  # all-padding: 0
        tok_row = token_ids_ptr + row * token_ids_stride
        bt_row = block_table_ptr + row * block_table_stride
        for i in range(0, n, BLOCK):
            j = i + offs
            t = start + j
            m = (j < n) & (t < num_tokens)
            p = (nc + j).to(tl.int64)
            ids = tl.load(tok_row + p, mask=m, other=0)
            blk = tl.load(bt_row + p // block_size, mask=m, other=0)
            tl.store(out_ids_ptr + t, ids.to(tl.int64), mask=m)
            tl.store(out_pos_ptr + t, p, mask=m)
            tl.store(out_slot_ptr + t, blk.to(tl.int64) * block_size + p % block_size, mask=m)
        out_row = out_bt_ptr + pid.to(tl.int64) * out_bt_stride
        for c0 in range(0, num_block_cols, BLOCK):
            c = c0 + offs
            m = c < num_block_cols
            tl.store(out_row + c, tl.load(bt_row + c, mask=m, other=0), mask=m)


def prepare_inputs_triton(
    idx_mapping: Tensor,  # [B] int32
    num_scheduled: Tensor,  # [B] int32
    token_ids: Tensor,  # [R, L] int32
    num_computed: Tensor,  # [R] int32
    block_table: Tensor,  # [R, M] int32
    block_size: int,
    num_tokens: int,
    num_block_cols: int,
    out: StepInputs | None = None,
) -> StepInputs:
    """Triton version of prepare_inputs: one launch of B + 1 programs (into `out` when given)."""
    _check_args(idx_mapping, num_scheduled, token_ids, num_computed, block_table, block_size, num_tokens, num_block_cols)
    dev = idx_mapping.device
    num_reqs = idx_mapping.shape[0]
    idx_mapping = idx_mapping.contiguous()
    num_scheduled = num_scheduled.contiguous()
    num_computed = num_computed.contiguous()
    if out is None:
        i32, i64 = {"dtype": torch.int32, "device": dev}, {"dtype": torch.int64, "device": dev}
        out = StepInputs(torch.empty(num_tokens, **i64), torch.empty(num_tokens, **i64),
                         torch.empty(num_reqs + 1, **i32), torch.empty(num_reqs, **i32),
                         torch.empty(num_tokens, **i64), torch.empty(num_reqs, num_block_cols, **i32),
                         torch.empty(num_reqs, **i64))
    input_ids, positions, query_start_loc, seq_lens = out.input_ids, out.positions, out.query_start_loc, out.seq_lens
    slot_mapping, gathered, logits_indices = out.slot_mapping, out.block_table, out.logits_indices
    _prepare_inputs_kernel[(num_reqs + 1,)](
        idx_mapping, num_scheduled, token_ids, token_ids.stride(0), num_computed, block_table, block_table.stride(0),
        input_ids, positions, query_start_loc, seq_lens, slot_mapping, gathered, max(num_block_cols, 1),
        logits_indices, num_reqs, num_tokens, num_block_cols, block_size, BLOCK=_BLOCK,
    )
    return StepInputs(input_ids, positions, query_start_loc, seq_lens, slot_mapping, gathered, logits_indices)


def prepare_inputs(
    idx_mapping: Tensor,  # [B] int32 row of the b-th request
    num_scheduled: Tensor,  # [B] int32 tokens scheduled for it this step
    token_ids: Tensor,  # [R, L] int32 persistent token history
    num_computed: Tensor,  # [R] int32 tokens already in the KV cache
    block_table: Tensor,  # [R, M] int32 persistent block table
    block_size: int,
    num_tokens: int,
    num_block_cols: int,
    use_triton: bool,
    out: StepInputs | None = None,
) -> StepInputs:
    """Build this step's inputs on the device (into `out`, e.g. StepBuffers.views, when given). Preconditions
    (not checked: that would sync): num_tokens >= sum(num_scheduled), num_computed[row] + num_scheduled[b] <= L
    and the block table covers those positions."""
    args = (idx_mapping, num_scheduled, token_ids, num_computed, block_table, block_size, num_tokens, num_block_cols)
    if use_triton:
        return prepare_inputs_triton(*args, out=out)
    ref = prepare_inputs_ref(*args)
    if out is None:
        return ref
    for name in StepInputs.__dataclass_fields__:
        getattr(out, name).copy_(getattr(ref, name))
    return out
