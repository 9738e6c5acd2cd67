"""Attention metadata for one step: the varlen batch layout the attention backends read.

Device tensors are built by the step's input preparation; the host-side lists are counts the
scheduler already knows, so backends may use them for shapes without synchronising.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Layout of one step's tokens: which request each token belongs to and where its KV lives."""

    num_reqs: int                   # B
    num_tokens: int                 # T, padding included
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32, context length including this step's tokens
    block_table: torch.Tensor       # [B, num_block_cols] int32, gathered per request
    slot_mapping: torch.Tensor      # [T] int64, -1 = padding (never written)
    query_lens_cpu: list[int] = field(default_factory=list)  # host copy, len B
    seq_lens_cpu: list[int] = field(default_factory=list)    # host copy, len B
    # Backends cache per-step derived tensors here (built once, reused by every layer).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.query_lens_cpu) != self.num_reqs or len(self.seq_lens_cpu) != self.num_reqs:
            raise ValueError(
                f"host query/seq lens must have num_reqs={self.num_reqs} entries, "
                f"got {len(self.query_lens_cpu)} and {len(self.seq_lens_cpu)}"
            )
