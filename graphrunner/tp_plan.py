"""The host plan rank 0 ships to the other tensor-parallel ranks each step: a SchedulerOutput made small.

A request travels whole only when its row is (re)initialised (`is_new`); afterwards a step names it by its row
and carries the one count the runner reads from it that changes (tokens generated so far). Workers keep the
request last sent for each row (`RowMirror`) and rebuild the SchedulerOutput the runner expects from it.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

from graphrunner.request import Request
from graphrunner.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class PlanEntry:
    """One ScheduledRequest on the wire."""

    row: int
    num_tokens: int
    is_new: bool
    new_block_ids: tuple[int, ...]
    first_new_block: int
    seq_len: int
    samples: bool
    num_cached: int
    num_generated: int          # request.num_generated on rank 0 at launch
    request: Request | None     # the request itself when is_new (host-only bookkeeping stripped), else None


def _slim(req: Request) -> Request:
    """A copy with what the runner reads (tokens, params, seed, sampling data), without the scheduler's
    bookkeeping (block ids, prefix keys) that only rank 0 needs."""
    out = copy.copy(req)
    out.output_token_ids = list(req.output_token_ids)
    out.block_ids = []
    out.block_hashes = []
    return out


def encode_plan(sched: SchedulerOutput) -> bytes:
    """The step's plan as bytes (pickled now: rank 0 mutates its requests after the launch)."""
    entries = [PlanEntry(s.row, s.num_tokens, s.is_new, tuple(s.new_block_ids), s.first_new_block, s.seq_len,
                         s.samples, s.num_cached, s.request.num_generated, _slim(s.request) if s.is_new else None)
               for s in sched.scheduled]
    return pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)


STOP = pickle.dumps(None)  # tells a worker to leave its loop


class RowMirror:
    """A worker's copy of the request in each state-table row, as of its last admission."""

    def __init__(self) -> None:
        self._rows: dict[int, Request] = {}

    def decode(self, data: bytes) -> SchedulerOutput | None:
        """The SchedulerOutput of a plan (None for STOP)."""
        entries: list[PlanEntry] | None = pickle.loads(data)
        if entries is None:
            return None
        scheduled = []
        for e in entries:
            if e.request is not None:
                self._rows[e.row] = e.request
            req = self._rows.get(e.row)
            if req is None:
                raise RuntimeError(f"tensor-parallel plan names row {e.row}, which was never admitted on this rank")
            # in flight = generated minus known: the runner reads only num_generated, which this restores
            req.num_inflight = e.num_generated - len(req.output_token_ids)
            scheduled.append(ScheduledRequest(req, e.row, e.num_tokens, e.is_new, list(e.new_block_ids),
                                              e.first_new_block, e.seq_len, e.samples, e.num_cached))
        return SchedulerOutput(scheduled)
