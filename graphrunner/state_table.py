"""The persistent per-request state table on the device, and its staged host writes.

Each live request owns one row for its whole life. The host never writes rows directly: it
stages (row, column, values) diffs and new rows' fields, and `apply_staged()` ships them in one pinned H2D copy
and applies them with one kernel (graphrunner.state_staging), in stream order with the steps around them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from graphrunner.host_tensors import to_device
from graphrunner.kernel_checks import int32_aligned
from graphrunner.penalty_counts import PenaltyCounts, fill_counts
from graphrunner.sampling_params import SamplingParams
from graphrunner.state_staging import ROW_WIDTH, RaggedSection, RowFieldTables, apply_staged, pack_new_row

# Per-row float sampling parameters, in the order they are packed for the H2D copy.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

_INT32_MAX = 2**31 - 1
_ZEROS = [0, 0, 0, 0]


@dataclass
class _RaggedStage:
    """Pending writes dst[row, start:start+len(values)] = values for one 2-D int32 table."""

    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    cu_lens: list[int] = field(default_factory=lambda: [0])
    values: array = field(default_factory=lambda: array("i"))  # int32: an int32 array source extends by memcpy

    def add(self, row: int, start: int, values: list[int] | array) -> None:
        if values:
            self.rows.append(row)
            self.starts.append(start)
            self.values.extend(values)
            self.cu_lens.append(len(self.values))


class StateTable:
    """Device tensors indexed by row; see docs/CONTRACTS.md for the meaning of each."""

    def __init__(self, max_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device,
                 use_triton: bool, vocab_size: int | None = None) -> None:
        """vocab_size: allocate the penalty statistics (PenaltyCounts) for that vocabulary; None: no request may
        use repetition / presence / frequency penalties (tests of other stages)."""
        self.device = device
        self.use_triton = use_triton
        # One extra row, never handed to a request: padded rows of a captured batch point at it. Its
        # num_tokens (1) stays above num_computed (0), so post_update never appends to it.
        self.padding_row = max_reqs
        max_reqs += 1
        i32: dict = {"dtype": torch.int32, "device": device}
        self.token_ids = torch.zeros(max_reqs, max_model_len, **i32)       # [R, L] int32
        self.num_tokens = torch.zeros(max_reqs, **i32)                     # [R] int32
        self.num_computed = torch.zeros(max_reqs, **i32)                   # [R] int32
        self.block_table = torch.zeros(max_reqs, max_blocks_per_req, **i32)  # [R, M] int32
        self.prompt_len = torch.zeros(max_reqs, **i32)                     # [R] int32
        self.seeds = torch.zeros(max_reqs, dtype=torch.int64, device=device)  # [R] int64
        self.top_k = torch.zeros(max_reqs, **i32)                          # [R] int32, 0 = off
        # [R] int32 draft tokens proposed for the row (speculative decoding); the drafts themselves sit in the
        # history's tail, token_ids[row, num_tokens : num_tokens + num_drafts], where a verify step reads them
        self.num_drafts = torch.zeros(max_reqs, **i32)
        # [R] float32 each: temperature (0 = greedy), top_p, min_p, repetition/presence/frequency penalty
        self.floats = torch.zeros(len(_FLOAT_FIELDS), max_reqs, dtype=torch.float32, device=device)
        (self.temperature, self.top_p, self.min_p, self.repetition_penalty, self.presence_penalty,
         self.frequency_penalty) = self.floats.unbind(0)  # views: writes to `floats` show through
        self.num_tokens[self.padding_row] = 1
        self.repetition_penalty[self.padding_row] = 1.0  # neutral: the penalty kernels skip padded rows
        # penalty statistics of every row, filled at admission and updated by post-update (docs/DECISIONS.md)
        self.penalties = (PenaltyCounts.allocate(max_reqs, vocab_size, self.repetition_penalty, self.presence_penalty,
                                                 self.frequency_penalty) if vocab_size is not None else None)
        self._tokens = _RaggedStage()
        self._blocks = _RaggedStage()
        self._new_rows: list[int] = []  # ROW_WIDTH int32 words per (re)initialised row (state_staging.pack_new_row)
        self._penalty_rows: list[int] = []  # new rows whose statistics are rebuilt from their history
        self._field_tables = RowFieldTables(
            (self.num_tokens, self.num_computed, self.prompt_len, self.top_k, self.num_drafts), self.floats,
            self.seeds)

    def stage_new_row(self, row: int, token_ids: list[int] | array, prompt_len: int, num_computed: int,
                      params: SamplingParams, seed: int) -> None:
        """(Re)initialise a row: its known tokens, computed count and sampling parameters."""
        self._tokens.add(row, 0, token_ids)
        top_k = min(max(0, params.top_k), _INT32_MAX)  # 0 = off; >= the vocabulary is off too (no int32 overflow)
        self._new_rows.extend(pack_new_row(row, (len(token_ids), num_computed, prompt_len, top_k, 0),
                                           tuple(float(getattr(params, name)) for name in _FLOAT_FIELDS), seed))
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            if self.penalties is None:
                raise ValueError("repetition / presence / frequency penalties need the state table's penalty "
                                 "statistics (StateTable built without vocab_size)")
            self._penalty_rows.append(row)

    def stage_blocks(self, row: int, first_col: int, block_ids: list[int]) -> None:
        self._blocks.add(row, first_col, block_ids)

    def apply_staged(self) -> None:
        """Apply every staged diff on the device, in stream order; clears the stage."""
        n_tok, n_blk, n_new = len(self._tokens.rows), len(self._blocks.rows), len(self._new_rows) // ROW_WIDTH
        if n_tok + n_blk + n_new == 0:
            return
        n_pen = len(self._penalty_rows)
        sections = [self._tokens.rows, self._tokens.starts, self._tokens.cu_lens, self._tokens.values,
                    self._blocks.rows, self._blocks.starts, self._blocks.cu_lens, self._blocks.values,
                    self._new_rows, self._penalty_rows]
        # each section starts on a 16-byte boundary: Triton specialises kernels on pointer alignment, and views at
        # offsets that followed the data would compile new kernel variants while serving
        packed = array("i")
        for sec in sections:
            packed.extend(sec)
            packed.extend(_ZEROS[:int32_aligned(len(sec)) - len(sec)])
        dev = to_device(packed, torch.int32, self.device)  # one H2D copy for all staged writes
        off = 0

        def take(n: int) -> torch.Tensor:
            nonlocal off
            start, off = off, off + int32_aligned(n)
            return dev[start:start + n]

        ragged = []
        for stage, dst in ((self._tokens, self.token_ids), (self._blocks, self.block_table)):
            n = len(stage.rows)
            ragged.append(RaggedSection(dst, take(n), take(n), take(n + 1), take(len(stage.values))))
        new_rows = take(n_new * ROW_WIDTH).view(n_new, ROW_WIDTH)
        apply_staged(ragged[0], ragged[1], new_rows, self._field_tables, self.use_triton)
        if n_pen and self.penalties is not None:  # after the history, prompt_len and num_tokens are written
            fill_counts(take(n_pen), self.token_ids, self.prompt_len, self.num_tokens, self.penalties, self.use_triton)
        self.discard_staged()

    def discard_staged(self) -> None:
        """Forget staged diffs (after they are applied, or when the step that staged them failed)."""
        self._tokens, self._blocks = _RaggedStage(), _RaggedStage()
        self._new_rows, self._penalty_rows = [], []
