"""Paged KV cache: the block pool the scheduler allocates from (reference counts, an LRU free queue and
the prefix cache's key -> block map), and the cache tensor itself.

Block 0 is a reserved null block: it is never handed out, so padding writes aimed at it can
never corrupt a real request's keys and values.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from graphrunner.config import ModelConfig
from graphrunner.prefix_cache import BlockHash

NULL_BLOCK = 0


class BlockPool:
    """Physical KV blocks (ids 1..num_blocks-1; 0 is the null block) with reference counts and a prefix cache.

    Free blocks wait in an LRU queue (the front is reused first) and keep their contents: a full block
    registered under its prefix key stays a cache hit until it is handed out again. A request's blocks are
    queued tail first when freed, so its last blocks are evicted before the prefix others may share. A block
    registered as `partial` holds the target's KV but not all of a speculative proposer's (computed while the
    proposer did not run): a lookup that needs the proposer's KV stops there, and a complete block computed
    later under the same key takes the key over.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # low ids first
        self._ref = [0] * num_blocks
        self._key: list[BlockHash | None] = [None] * num_blocks  # the prefix key a block is registered under
        self._cached: dict[BlockHash, int] = {}
        self._partial: set[int] = set()  # registered blocks without the proposer's KV

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh block ids (evicting their cached contents), or None (nothing taken) when too few are free."""
        if count > len(self._free):
            return None
        taken = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            key = self._key[block]
            if key is not None:
                del self._cached[key]
                self._key[block] = None
                self._partial.discard(block)
            self._ref[block] = 1
            taken.append(block)
        return taken

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block nobody holds joins the free queue (tail blocks first)."""
        for block in reversed(block_ids):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    # -- the prefix cache --------------------------------------------------------------------
    def lookup(self, keys: list[BlockHash], complete_only: bool = False) -> list[int]:
        """Blocks of the longest cached prefix of `keys` (not yet held: call `hold`); complete_only: it ends at the
        first partial block (a request whose proposer reads these blocks' KV)."""
        hits = []
        for key in keys:
            block = self._cached.get(key)
            if block is None or (complete_only and block in self._partial):
                break
            hits.append(block)
        return hits

    def hold(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (out of the free queue if nobody held them)."""
        for block in block_ids:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def register(self, block_id: int, key: BlockHash, partial: bool = False) -> None:
        """A full, computed block becomes a hit for `key`. The first block registered under a key keeps it,
        unless that one is partial and this one is not."""
        if not self.enable_caching or self._key[block_id] is not None:
            return
        old = self._cached.get(key)
        if old is not None:
            if partial or old not in self._partial:
                return
            self._key[old] = None  # its holders keep its contents; it is no longer a hit
            self._partial.discard(old)
        self._cached[key] = block_id
        self._key[block_id] = key
        if partial:
            self._partial.add(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while any block is held, as vLLM."""
        if any(self._ref):
            return False
        self._cached.clear()
        self._partial.clear()
        self._key = [None] * self.num_blocks
        return True


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
