"""The forward context: attention metadata and KV cache visible to every attention layer.

The runner sets it around a forward pass, so model code keeps the plain
`forward(input_ids, positions)` signature that torch.compile and CUDA graphs like.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from graphrunner.attention.metadata import AttentionMetadata

ATTENTION_BACKENDS = ("reference", "triton")


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    backend: str = "reference"  # "reference" (PyTorch gather + SDPA) or "triton" (unified paged kernel)


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(meta: AttentionMetadata, kv_cache: torch.Tensor,
                    backend: str = "reference") -> Iterator[ForwardContext]:
    global _CURRENT
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")
    previous, _CURRENT = _CURRENT, ForwardContext(meta, kv_cache, backend)
    try:
        yield _CURRENT
    finally:
        _CURRENT = previous


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("attention called outside graphrunner.attention.forward_context(...)")
    return _CURRENT
