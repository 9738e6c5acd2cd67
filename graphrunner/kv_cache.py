"""Paged KV cache: the block pool the scheduler allocates from, and the cache tensor itself.

Block 0 is a reserved null block: it is never handed out, so padding writes aimed at it can
never corrupt a real request's keys and values.
"""

from __future__ import annotations

import torch

from graphrunner.config import ModelConfig

NULL_BLOCK = 0


class BlockPool:
    """Free list of physical KV blocks (ids 1..num_blocks-1; 0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        # Popped from the end: low ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` block ids, or None (nothing taken) when not enough are free."""
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zero-filled."""
    shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
