"""The host plan rank 0 ships to the other tensor-parallel ranks each step: a SchedulerOutput made small.

Counts travel as flat int32 arrays. A request travels whole only when its row is (re)initialised (`is_new`);
afterwards a step names it by its row and carries the one count the runner reads from it that changes (tokens
generated so far). Workers keep the
request last sent for each row (`RowMirror`) and rebuild the SchedulerOutput the runner expects from it.
"""

from __future__ import annotations

import copy
import pickle
from array import array

from graphrunner.request import Request
from graphrunner.scheduler import ScheduledRequest, SchedulerOutput

# per scheduled request: row, num_tokens, first_new_block, seq_len, num_cached, num_generated, flags, new blocks
_FIELDS = 8
_IS_NEW, _SAMPLES = 1, 2


def _slim(req: Request) -> Request:
    """A copy with what the runner reads (tokens, params, seed, sampling data), without the scheduler's
    bookkeeping (block ids, prefix keys) that only rank 0 needs."""
    out = copy.copy(req)
    out.output_token_ids = list(req.output_token_ids)
    out.block_ids = []
    out.block_hashes = []
    out._prompt_array = None  # rebuilt on the worker when its runner stages the row
    return out


def encode_plan(sched: SchedulerOutput) -> bytes:
    """The step's plan as bytes (pickled now: rank 0 mutates its requests after the launch). Counts travel as
    flat integer arrays, new blocks as one flat array, and only newly (re)admitted requests as objects."""
    scheduled = sched.scheduled
    ints = array("i")
    blocks = array("i")
    new: list[tuple[int, Request]] = []
    for i, s in enumerate(scheduled):
        ints.extend((s.row, s.num_tokens, s.first_new_block, s.seq_len, s.num_cached, s.request.num_generated,
                     (_IS_NEW if s.is_new else 0) | (_SAMPLES if s.samples else 0), len(s.new_block_ids)))
        blocks.extend(s.new_block_ids)
        if s.is_new:
            new.append((i, _slim(s.request)))
    return pickle.dumps((ints.tobytes(), blocks.tobytes(), new), protocol=pickle.HIGHEST_PROTOCOL)


STOP = pickle.dumps(None)  # tells a worker to leave its loop


class RowMirror:
    """A worker's copy of the request in each state-table row, as of its last admission."""

    def __init__(self) -> None:
        self._rows: dict[int, Request] = {}

    def decode(self, data: bytes) -> SchedulerOutput | None:
        """The SchedulerOutput of a plan (None for STOP)."""
        payload = pickle.loads(data)
        if payload is None:
            return None
        ints_bytes, blocks_bytes, new = payload
        ints, blocks = array("i"), array("i")
        ints.frombytes(ints_bytes)
        blocks.frombytes(blocks_bytes)
        fresh = dict(new)
        scheduled = []
        at = 0
        for i in range(len(ints) // _FIELDS):
            row, num_tokens, first_block, seq_len, num_cached, num_generated, flags, num_blocks = \
                ints[i * _FIELDS:(i + 1) * _FIELDS]
            if i in fresh:
                self._rows[row] = fresh[i]
            req = self._rows.get(row)
            if req is None:
                raise RuntimeError(f"tensor-parallel plan names row {row}, which was never admitted on this rank")
            # in flight = generated minus known: the runner reads only num_generated, which this restores
            req.num_inflight = num_generated - len(req.output_token_ids)
            scheduled.append(ScheduledRequest(req, row, num_tokens, bool(flags & _IS_NEW), list(blocks[at:at + num_blocks]),
                                              first_block, seq_len, bool(flags & _SAMPLES), num_cached))
            at += num_blocks
        return SchedulerOutput(scheduled)
