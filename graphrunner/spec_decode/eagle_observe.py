"""Where the EAGLE head's observation of a step reads: the token each scheduled position predicts (the one now known
at position + 1) and each request's last accepted position, as one Triton launch next to its PyTorch reference.
The reference is ~15 small PyTorch kernels (searchsorted, gathers, clamps), ~20 µs of a verify step on the H200
(docs/BENCHMARKS.md, twenty-eighth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import step_sizes

_BLOCK = 64  # positions per loop iteration of a request's program


def observe_index_ref(
    idx_mapping: Tensor,  # [B] int32, B >= 1
    query_start_loc: Tensor,  # [B + 1] int32
    positions: Tensor,  # [T] int64, T >= 1 (tokens past query_start_loc[B] are padding)
    token_ids: Tensor,  # [R, L] int32, after the step's post-update
    num_computed: Tensor,  # [R] int32, after the step's post-update
) -> tuple[Tensor, Tensor]:
    """(next_ids [T] int64: token_ids[row, min(position + 1, L - 1)] of each position's request (padding positions:
    the last request's), last [B] int64: the index in the step of each request's last accepted position, clamped
    into its own tokens and to T - 1)."""
    b, t = idx_mapping.shape[0], positions.shape[0]
    max_len = token_ids.shape[1]
    rows = idx_mapping.long()  # [B] int64
    qsl = query_start_loc.long()  # [B + 1] int64
    tok = torch.arange(t, dtype=torch.int64, device=rows.device)  # [T] int64
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp(max=b - 1)  # [T] int64; padding -> B-1
    nxt = (positions + 1).clamp(max=max_len - 1)  # [T] int64
    next_ids = token_ids[rows[req], nxt].long()  # [T] int64
    first = qsl[:-1]  # [B] int64
    count = qsl[1:] - first  # [B] int64
    start = positions[first.clamp(max=t - 1)]  # [B] int64: each request's first position (num_computed before)
    advanced = num_computed.index_select(0, rows).long() - start  # [B] int64: positions now accepted
    last = first + torch.minimum((advanced - 1).clamp(min=0), (count - 1).clamp(min=0))  # [B] int64
    return next_ids, last.clamp(max=t - 1)


@triton.jit(do_not_specialize=step_sizes("num_reqs", "num_tokens"))
def _observe_index_kernel(
    idx_mapping_ptr,  # [B] int32
    qsl_ptr,  # [B + 1] int32
    positions_ptr,  # [T] int64
    token_ids_ptr,  # [R, L] int32
    stride_tok,
    num_computed_ptr,  # [R] int32
    next_ids_ptr,  # [T] int64, out
    last_ptr,  # [B] int64, out
    num_reqs,
    num_tokens,
    max_len,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    first = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    count = end - first
    # the last request's program also covers the padding positions past the real tokens (the reference's
    # searchsorted sends them there)
    stop = tl.where(b == num_reqs - 1, num_tokens, end)
    row_ptr = token_ids_ptr + row * stride_tok
    for s in range(first, stop, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < stop
        pos = tl.load(positions_ptr + offs, mask=m, other=0)
        nxt = tl.minimum(pos + 1, max_len - 1)
        tl.store(next_ids_ptr + offs, tl.load(row_ptr + nxt, mask=m, other=0).to(tl.int64), mask=m)
    start = tl.load(positions_ptr + tl.minimum(first, num_tokens - 1))
    advanced = tl.load(num_computed_ptr + row).to(tl.int64) - start
    last = first.to(tl.int64) + tl.minimum(tl.maximum(advanced - 1, 0), tl.maximum(count - 1, 0)).to(tl.int64)
    tl.store(last_ptr + b, tl.minimum(last, num_tokens - 1))


def observe_index(idx_mapping: Tensor, query_start_loc: Tensor, positions: Tensor, token_ids: Tensor,
                  num_computed: Tensor, use_triton: bool) -> tuple[Tensor, Tensor]:
    """observe_index_ref's maps (see there), as one Triton launch when use_triton."""
    b, t = idx_mapping.shape[0], positions.shape[0]
    if b == 0 or t == 0:
        raise ValueError(f"the EAGLE head observes a step with requests and tokens, got {b} and {t}")
    if not use_triton:
        return observe_index_ref(idx_mapping, query_start_loc, positions, token_ids, num_computed)
    dev = positions.device
    next_ids = torch.empty(t, dtype=torch.int64, device=dev)  # [T] int64
    last = torch.empty(b, dtype=torch.int64, device=dev)  # [B] int64
    _observe_index_kernel[(b,)](
        idx_mapping.contiguous(), query_start_loc.contiguous(), positions.contiguous(), token_ids,
        token_ids.stride(0), num_computed, next_ids, last, b, t, token_ids.shape[1], BLOCK=_BLOCK, num_warps=1,
    )
    return next_ids, last
