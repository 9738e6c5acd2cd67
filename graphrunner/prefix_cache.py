"""Prefix-cache block hashes: a full block's key chains its parent's key, its token ids and any extra keys
(a request's cache_salt), through SHA-256, so equal keys mean equal prefixes (never Python's `hash()`)."""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array

BlockHash = bytes  # a SHA-256 digest (32 bytes)
_ROOT = b"graphrunner-prefix-cache-v2"  # v2: token ids hashed as int32 (v1: int64)
assert array("i").itemsize == 4, "token arrays are int32"


def hash_block(parent: BlockHash | None, token_ids: list[int], salt: str | None = None) -> BlockHash:
    """The key of one full block: SHA-256 over (parent key, its token ids, the salt, for the first block)."""
    return _hash_packed(parent, struct.pack(f"<{len(token_ids)}i", *token_ids), salt)


def _hash_packed(parent: BlockHash | None, packed: bytes | memoryview, salt: str | None) -> BlockHash:
    """hash_block over token ids already packed as little-endian int32."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(packed)
    if parent is None and salt is not None:  # the first key carries the salt, and every later key chains it
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int] | array, num_tokens: int, block_size: int,
                        salt: str | None = None, start: int = 0) -> None:
    """Append to `hashes` the keys of the full blocks within the first `num_tokens` tokens that it lacks;
    token_ids[j] is token `start + j` (a caller may pass only the tail the missing blocks need); an int32 array
    (Request.token_array) is hashed without converting its values."""
    first, end = len(hashes), num_tokens // block_size
    if first >= end:
        return
    # the needed tokens as little-endian int32 bytes (what hash_block packs), then a hash per block over a slice:
    # a 4K-token prompt's keys cost ~0.2 ms instead of ~0.8 ms of per-block packing
    lo, hi = first * block_size - start, end * block_size - start
    if isinstance(token_ids, array) and token_ids.typecode == "i" and sys.byteorder == "little":
        buf = memoryview(token_ids).cast("B")[4 * lo:4 * hi]
    else:
        packed = array("i", token_ids[lo:hi])
        if sys.byteorder != "little":
            packed.byteswap()
        buf = memoryview(packed).cast("B")
    width = 4 * block_size
    parent = hashes[first - 1] if first else None
    for i in range(end - first):
        parent = _hash_packed(parent, buf[i * width:(i + 1) * width], salt)
        hashes.append(parent)


class RecentKeys:
    """The block keys of recently admitted prompts, found again by comparing token ids instead of hashing.

    A prompt whose first block (and salt) matches a remembered one takes the keys of the whole blocks both share
    (their longest common prefix, found by a binary search of C-speed array comparisons, as SGLang's radix cache
    matches prefixes by comparison) and hashes only the rest: a repeated 4K-token system prompt costs one SHA-256
    instead of 256 (~0.3 ms of host time per request on the H200's host). Equal tokens under an equal first key give
    equal keys, so the result is exactly extend_block_hashes'. At most `capacity` prompts, least recent out first.
    """

    def __init__(self, block_size: int, capacity: int = 16) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._entries: dict[BlockHash, tuple[array, list[BlockHash]]] = {}  # first key -> (tokens, their keys)

    def keys(self, tokens: array, num_tokens: int, salt: str | None = None) -> list[BlockHash]:
        """The keys of the full blocks within the first num_tokens of tokens (int32); remembers them."""
        bs = self.block_size
        if num_tokens < bs:
            return []
        keys: list[BlockHash] = []
        extend_block_hashes(keys, tokens, bs, bs, salt)  # the first key: it carries the salt
        seen = self._entries.pop(keys[0], None)
        if seen is not None:
            old_tokens, old_keys = seen
            lo, hi = 1, min(num_tokens // bs, len(old_keys))  # blocks known shared (the first), at most shareable
            while lo < hi:  # the largest shared block count: prefix equality is monotone in the count
                mid = (lo + hi + 1) // 2
                if tokens[:mid * bs] == old_tokens[:mid * bs]:
                    lo = mid
                else:
                    hi = mid - 1
            keys = old_keys[:lo]
        extend_block_hashes(keys, tokens, num_tokens, bs, salt)  # the blocks past the shared ones
        if seen is not None and len(seen[1]) > len(keys):  # keep the longer of the two as the remembered prompt
            self._entries[keys[0]] = seen
        else:
            self._entries[keys[0]] = (tokens, keys)
        while len(self._entries) > self.capacity:
            del self._entries[next(iter(self._entries))]
        return list(keys)
