"""Where the draft model's observation of a step reads, after the step's post-update: each request's scheduled
positions plus the one after them (the token the step just made known: the sampled or bonus token, or the next
prompt token of a chunk), each request's first position (where the observation's prep kernel starts the row), and
the index of each request's new last position (num_computed) in that observation, whose output gives the first
draft. One Triton launch next to its PyTorch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import step_sizes

_BLOCK = 128  # requests per loop iteration of the prefix sum


def observe_counts_ref(
    idx_mapping: Tensor,  # [B] int32, B >= 1
    query_start_loc: Tensor,  # [B + 1] int32, the step's
    positions: Tensor,  # [T] int64, the step's (tokens past query_start_loc[B] are padding), T >= 1
    num_computed: Tensor,  # [R] int32, after the step's post-update
    starts: Tensor,  # [R] int32, in place: the first position of each request with tokens
    max_len: int,  # positions per row (max_model_len)
) -> tuple[Tensor, Tensor]:
    """Writes starts[row] = each request's first scheduled position (rows without tokens keep theirs); returns
    (counts [B] int32: each request's scheduled tokens + 1, cut at max_len, 0 for a request with none;
    last [B] int64: the index of each request's position num_computed among the observation's tokens, clamped into
    its own tokens and to T + B - 1, the observation's padded size less one)."""
    t = positions.shape[0]
    qsl = query_start_loc.long()  # [B + 1] int64
    first, count = qsl[:-1], qsl[1:] - qsl[:-1]  # [B] int64
    start = positions[first.clamp(max=t - 1)]  # [B] int64: each request's first position
    counts = torch.where(count > 0, torch.minimum(count + 1, max_len - start), 0)  # [B] int64
    obs_first = torch.cumsum(counts, 0) - counts  # [B] int64, exclusive
    # [B] int64: how far each request's num_computed now lies past the step's first position
    advanced = num_computed.index_select(0, idx_mapping.long()).long() - start
    last = obs_first + torch.minimum(advanced.clamp(min=0), (counts - 1).clamp(min=0))
    bound = t + count.shape[0] - 1  # the observation's padded size is T + B
    rows = idx_mapping.long()  # [B] int64
    starts[rows] = torch.where(count > 0, start, starts[rows].long()).to(torch.int32)
    return counts.to(torch.int32), last.clamp(max=bound)


@triton.jit(do_not_specialize=step_sizes("num_reqs", "num_tokens"))
def _observe_counts_kernel(
    idx_mapping_ptr,  # [B] int32
    qsl_ptr,  # [B + 1] int32
    positions_ptr,  # [T] int64
    num_computed_ptr,  # [R] int32
    starts_ptr,  # [R] int32, out (rows with tokens)
    counts_ptr,  # [B] int32, out
    last_ptr,  # [B] int64, out
    num_reqs,
    num_tokens,
    max_len,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    # the exclusive prefix sum of the counts before b, each recomputed from the step's query_start_loc
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for j0 in range(0, b, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < b
        f = tl.load(qsl_ptr + j, mask=m, other=0)
        n = tl.load(qsl_ptr + j + 1, mask=m, other=0) - f
        s = tl.load(positions_ptr + tl.minimum(f, num_tokens - 1), mask=m, other=0)
        acc += tl.where(m & (n > 0), tl.minimum(n.to(tl.int64) + 1, max_len - s), 0)
    obs_first = tl.sum(acc, axis=0)
    f = tl.load(qsl_ptr + b)
    n = (tl.load(qsl_ptr + b + 1) - f).to(tl.int64)
    s = tl.load(positions_ptr + tl.minimum(f, num_tokens - 1))
    count = tl.where(n > 0, tl.minimum(n + 1, max_len - s), 0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    advanced = tl.load(num_computed_ptr + row).to(tl.int64) - s
    last = obs_first + tl.minimum(tl.maximum(advanced, 0), tl.maximum(count - 1, 0))
    tl.store(starts_ptr + row, s.to(tl.int32), mask=n > 0)
    tl.store(counts_ptr + b, count.to(tl.int32))
    tl.store(last_ptr + b, tl.minimum(last, num_tokens + num_reqs - 1))


def observe_counts(idx_mapping: Tensor, query_start_loc: Tensor, positions: Tensor, num_computed: Tensor,
                   starts: Tensor, max_len: int, use_triton: bool) -> tuple[Tensor, Tensor]:
    """observe_counts_ref's counts and indices (see there), as one Triton launch when use_triton."""
    b, t = idx_mapping.shape[0], positions.shape[0]
    if b == 0 or t == 0:
        raise ValueError(f"the draft model observes a step with requests and tokens, got {b} and {t}")
    if query_start_loc.shape[0] != b + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {b} requests (needs {b + 1})")
    if not use_triton:
        return observe_counts_ref(idx_mapping, query_start_loc, positions, num_computed, starts, max_len)
    dev = positions.device
    counts = torch.empty(b, dtype=torch.int32, device=dev)  # [B] int32
    last = torch.empty(b, dtype=torch.int64, device=dev)  # [B] int64
    _observe_counts_kernel[(b,)](idx_mapping.contiguous(), query_start_loc.contiguous(), positions.contiguous(),
                                 num_computed, starts, counts, last, b, t, max_len, BLOCK=_BLOCK, num_warps=1)
    return counts, last
