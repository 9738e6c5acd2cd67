"""The logits-row layout of a verify step: which token rows get logits, and the expanded idx_mapping.

Request b verifies num_spec[b] drafts: its last 1 + num_spec[b] scheduled tokens (the last accepted token and
the drafts) get logits rows, cu_num_logits[b] .. cu_num_logits[b + 1] - 1. Every count here is known to the host
when it schedules, so the layout is built on the host and shipped in one small H2D copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner.host_tensors import to_device


@dataclass(frozen=True)
class SpecLayout:
    num_reqs: int              # B
    num_logits: int            # N = sum(1 + num_spec[b])
    max_spec: int              # K = max(num_spec): width of the draft / output grids
    first_row: tuple[int, ...]  # host copy of cu_num_logits[:B]: logits row of each request's first emitted token
    num_spec: torch.Tensor        # [B] int32 draft slots scheduled for request b
    cu_num_logits: torch.Tensor   # [B + 1] int32
    logits_indices: torch.Tensor  # [N] int64 token index (in the step) of each logits row
    expanded_idx: torch.Tensor    # [N] int32 state-table row of each logits row (the expanded idx_mapping)
    row_req: torch.Tensor         # [N] int64 request b of each logits row
    row_j: torch.Tensor           # [N] int64 index of the row within its request (0 = first verified position)


def uniform_spec_layout(idx_mapping: torch.Tensor, num_scheduled: torch.Tensor, k: int) -> SpecLayout:
    """The layout of a uniform verify step (a FULL graph's): every request has 1 + k tokens and as many logits rows,
    built on the device from the step rows (padding requests, 0 tokens, verify nothing)."""
    p, q, dev = idx_mapping.shape[0], 1 + k, idx_mapping.device
    ar = torch.arange(p * q, dtype=torch.int64, device=dev)  # [P * q] int64
    return SpecLayout(
        p, p * q, k, tuple(range(0, p * q, q)), (num_scheduled - 1).clamp(min=0),
        torch.arange(p + 1, dtype=torch.int32, device=dev) * q, ar, idx_mapping[:, None].expand(p, q).reshape(-1), ar // q, ar % q)


def build_spec_layout(rows: list[int], counts: list[int], num_spec: list[int], device: torch.device) -> SpecLayout:
    """rows / counts / num_spec: per scheduled request, its state row, tokens scheduled and draft slots."""
    if not len(rows) == len(counts) == len(num_spec):
        raise ValueError(f"rows ({len(rows)}), counts ({len(counts)}) and num_spec ({len(num_spec)}) differ in length")
    cu = [0]
    logits_indices: list[int] = []
    expanded: list[int] = []
    row_req: list[int] = []
    row_j: list[int] = []
    end = 0
    for b, (row, n, s) in enumerate(zip(rows, counts, num_spec)):
        if not 0 <= s < max(n, 1):
            raise ValueError(f"request {b}: {s} draft slots need at least {s + 1} scheduled tokens, got {n}")
        end += n
        logits_indices += range(end - 1 - s, end)
        expanded += [row] * (1 + s)
        row_req += [b] * (1 + s)
        row_j += range(1 + s)
        cu.append(cu[-1] + 1 + s)
    b, n_rows = len(rows), cu[-1]
    packed = to_device(num_spec + cu + logits_indices + expanded + row_req + row_j, torch.int64, device)
    off = [0, b, 2 * b + 1, 2 * b + 1 + n_rows, 2 * b + 1 + 2 * n_rows, 2 * b + 1 + 3 * n_rows,
           2 * b + 1 + 4 * n_rows]
    part = [packed[off[i]:off[i + 1]] for i in range(6)]
    return SpecLayout(b, n_rows, max(num_spec, default=0), tuple(cu[:-1]), part[0].to(torch.int32),
                      part[1].to(torch.int32), part[2], part[3].to(torch.int32), part[4], part[5])
