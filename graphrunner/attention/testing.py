"""Test helpers: attention metadata and an empty KV cache for a batch laid out contiguously.

Used by model tests that run a forward pass without the scheduler or the runner.
"""

from __future__ import annotations

import torch

from graphrunner.attention.metadata import AttentionMetadata


def contiguous_batch(
    query_lens: list[int], context_lens: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: torch.device | str,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Request b owns consecutive blocks (block 0 is the null block); its last query_lens[b] of
    context_lens[b] tokens are this step's queries, the earlier ones must already be in the cache."""
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens must have the same length")
    if any(q < 1 or q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError("each query_len must be in [1, context_len]")
    device = torch.device(device)
    blocks_per_req = [-(-c // block_size) for c in context_lens]
    cols = max(blocks_per_req, default=1)
    table = torch.zeros(len(query_lens), cols, dtype=torch.int32)
    slots: list[int] = []
    next_block = 1
    for b, (q, c) in enumerate(zip(query_lens, context_lens)):
        ids = torch.arange(next_block, next_block + blocks_per_req[b], dtype=torch.int32)
        table[b, : len(ids)] = ids
        next_block += blocks_per_req[b]
        slots += [int(ids[p // block_size]) * block_size + p % block_size for p in range(c - q, c)]
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    meta = AttentionMetadata(
        num_reqs=len(query_lens), num_tokens=sum(query_lens), max_query_len=max(query_lens, default=0),
        max_seq_len=max(context_lens, default=0), block_size=block_size,
        query_start_loc=qsl.to(device), seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(context_lens),
    )
    kv_cache = torch.zeros(num_layers, 2, next_block, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return meta, kv_cache
