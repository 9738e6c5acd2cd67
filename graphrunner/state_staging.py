"""The state table's staged host writes, applied on the device: ragged writes into the token history and the
block table, and the scalar fields of (re)initialised rows (counts, top-k, the float sampling parameters, seeds).

All of it arrives in one packed int32 buffer (floats as their bits, an int64 seed as two words); the Triton path
applies everything in ONE launch, where the reference spends a dozen PyTorch ops (on the H200's host a 4K-token
prefix-cache hit's stage went 0.81 -> 0.66 ms: docs/BENCHMARKS.md, fifteenth session).
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor, step_sizes
from graphrunner.state_kernels import apply_ragged_writes_ref, ragged_write_one

NUM_INT_FIELDS = 5    # num_tokens, num_computed, prompt_len, top_k, num_drafts
NUM_FLOAT_FIELDS = 6  # temperature, top_p, min_p, repetition / presence / frequency penalty
# one packed new row: [row, the int fields, the float fields' bits, seed low word, seed high word]
ROW_WIDTH = 1 + NUM_INT_FIELDS + NUM_FLOAT_FIELDS + 2
_ROWS_PER_ITER = 64
_BLOCK = 256  # values per iteration of a ragged write


def pack_new_row(row: int, ints: tuple[int, ...], floats: tuple[float, ...], seed: int) -> list[int]:
    """The ROW_WIDTH int32 words of one new row (floats as float32 bits, the int64 seed as two int32 words)."""
    if len(ints) != NUM_INT_FIELDS or len(floats) != NUM_FLOAT_FIELDS:
        raise ValueError(f"a new row has {NUM_INT_FIELDS} int and {NUM_FLOAT_FIELDS} float fields")
    # native byte order both ways (array), so the words are the float32 / int64 bits on any host; array('f')
    # rounds as the float32 tensors did (values past float32's range become inf, as there)
    bits = array("i", array("f", floats).tobytes())
    seed_words = array("i", array("q", [seed]).tobytes())
    lo, hi = seed_words if sys.byteorder == "little" else seed_words[::-1]
    return [row, *ints, *bits, lo, hi]


@dataclass(frozen=True)
class RaggedSection:
    """Staged writes dst[rows[n], starts[n]:] = values[cu_lens[n] : cu_lens[n + 1]] into one table."""

    dst: Tensor      # [R, L] int32
    rows: Tensor     # [N] int32
    starts: Tensor   # [N] int32
    cu_lens: Tensor  # [N + 1] int32
    values: Tensor   # [total] int32


@dataclass(frozen=True)
class RowFieldTables:
    """Where the new rows' fields go: the state table's per-row tensors."""

    ints: tuple[Tensor, ...]  # NUM_INT_FIELDS x [R] int32
    floats: Tensor            # [NUM_FLOAT_FIELDS, R] float32
    seeds: Tensor             # [R] int64


def apply_staged_ref(tokens: RaggedSection, blocks: RaggedSection, new_rows: Tensor, dst: RowFieldTables) -> None:
    """PyTorch reference: the ragged writes, then the fields of new_rows [n, ROW_WIDTH] int32 by index_copy_."""
    for sec in (tokens, blocks):
        if sec.rows.shape[0]:
            apply_ragged_writes_ref(sec.dst, sec.rows, sec.starts, sec.cu_lens, sec.values)
    if new_rows.shape[0] == 0:
        return
    rows = new_rows[:, 0].long()  # [n] int64
    for j, table in enumerate(dst.ints):
        table.index_copy_(0, rows, new_rows[:, 1 + j].contiguous())
    f0 = 1 + NUM_INT_FIELDS
    floats = new_rows[:, f0:f0 + NUM_FLOAT_FIELDS].contiguous().view(torch.float32)  # [n, F] float32
    dst.floats.index_copy_(1, rows, floats.t().contiguous())
    lo, hi = new_rows[:, f0 + NUM_FLOAT_FIELDS].long(), new_rows[:, f0 + NUM_FLOAT_FIELDS + 1].long()
    dst.seeds.index_copy_(0, rows, (hi << 32) | (lo & 0xFFFFFFFF))


@triton.jit(do_not_specialize=step_sizes("n_tok", "n_blk", "n_new"))
def _apply_staged_kernel(
    tok_ptr, tok_stride, tok_rows, tok_starts, tok_cu, tok_values, n_tok,
    blk_ptr, blk_stride, blk_rows, blk_starts, blk_cu, blk_values, n_blk,
    new_ptr, n_new,  # [n_new, ROW_WIDTH] int32
    num_tokens_ptr, num_computed_ptr, prompt_len_ptr, top_k_ptr, num_drafts_ptr,  # [R] int32 each
    floats_ptr, floats_stride,  # [NUM_FLOAT_FIELDS, R] float32
    seeds_ptr,  # [R] int64
    WIDTH: tl.constexpr, F0: tl.constexpr, NUM_FLOATS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < n_tok:
        ragged_write_one(tok_ptr, tok_stride, tok_rows, tok_starts, tok_cu, tok_values, pid, BLOCK)
    elif pid < n_tok + n_blk:
        ragged_write_one(blk_ptr, blk_stride, blk_rows, blk_starts, blk_cu, blk_values, pid - n_tok, BLOCK)
    else:  # the last program: every new row's fields
        for r0 in range(0, n_new, ROWS):
            r = r0 + tl.arange(0, ROWS)
            ok = r < n_new
            src = new_ptr + r * WIDTH
            row = tl.load(src, mask=ok, other=0)
            tl.store(num_tokens_ptr + row, tl.load(src + 1, mask=ok), mask=ok)
            tl.store(num_computed_ptr + row, tl.load(src + 2, mask=ok), mask=ok)
            tl.store(prompt_len_ptr + row, tl.load(src + 3, mask=ok), mask=ok)
            tl.store(top_k_ptr + row, tl.load(src + 4, mask=ok), mask=ok)
            tl.store(num_drafts_ptr + row, tl.load(src + 5, mask=ok), mask=ok)
            for f in tl.static_range(NUM_FLOATS):  # F0: the first float word (pack_new_row's layout)
                bits = tl.load(src + F0 + f, mask=ok)
                tl.store(floats_ptr + f * floats_stride + row, bits.to(tl.float32, bitcast=True), mask=ok)
            lo = tl.load(src + F0 + NUM_FLOATS, mask=ok).to(tl.int64) & 0xFFFFFFFF
            hi = tl.load(src + F0 + NUM_FLOATS + 1, mask=ok).to(tl.int64)
            tl.store(seeds_ptr + row, (hi << 32) | lo, mask=ok)


def apply_staged_triton(tokens: RaggedSection, blocks: RaggedSection, new_rows: Tensor,
                        dst: RowFieldTables) -> None:
    """Triton version: one launch, a program per ragged write plus one for all new rows' fields."""
    n_tok, n_blk, n_new = tokens.rows.shape[0], blocks.rows.shape[0], new_rows.shape[0]
    if n_tok + n_blk + n_new == 0:
        return
    dev = dst.seeds.device
    check_tensor(new_rows, "new_rows", torch.int32, 2, dev)
    if new_rows.shape[1] != ROW_WIDTH or not new_rows.is_contiguous():
        raise ValueError(f"new_rows must be a contiguous [n, {ROW_WIDTH}] int32 tensor")
    if dst.floats.stride(1) != 1 or len(dst.ints) != NUM_INT_FIELDS:
        raise ValueError("floats must be [F, R] with unit row stride, with one table per int field")
    for sec in (tokens, blocks):
        if sec.dst.stride(1) != 1:
            raise ValueError("a ragged destination needs unit stride along its last dimension")
    _apply_staged_kernel[(n_tok + n_blk + (1 if n_new else 0),)](
        tokens.dst, tokens.dst.stride(0), tokens.rows, tokens.starts, tokens.cu_lens, tokens.values, n_tok,
        blocks.dst, blocks.dst.stride(0), blocks.rows, blocks.starts, blocks.cu_lens, blocks.values, n_blk,
        new_rows, n_new, *dst.ints, dst.floats, dst.floats.stride(0), dst.seeds,
        WIDTH=ROW_WIDTH, F0=1 + NUM_INT_FIELDS, NUM_FLOATS=NUM_FLOAT_FIELDS, ROWS=_ROWS_PER_ITER, BLOCK=_BLOCK,
    )


def apply_staged(tokens: RaggedSection, blocks: RaggedSection, new_rows: Tensor, dst: RowFieldTables,
                 use_triton: bool) -> None:
    """Apply a step's staged writes (tokens, blocks, new rows [n, ROW_WIDTH] int32) without synchronising.
    Preconditions as apply_ragged_writes' (non-overlapping writes inside their rows); new rows are distinct."""
    (apply_staged_triton if use_triton else apply_staged_ref)(tokens, blocks, new_rows, dst)
