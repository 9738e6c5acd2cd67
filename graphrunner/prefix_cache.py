"""Prefix-cache block hashes: a full block's key chains its parent's key, its token ids and any extra keys
(a request's cache_salt), through SHA-256, so equal keys mean equal prefixes (never Python's `hash()`)."""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array

BlockHash = bytes  # a SHA-256 digest (32 bytes)
_ROOT = b"graphrunner-prefix-cache-v1"


def hash_block(parent: BlockHash | None, token_ids: list[int], salt: str | None = None) -> BlockHash:
    """The key of one full block: SHA-256 over (parent key, its token ids, the salt, for the first block)."""
    return _hash_packed(parent, struct.pack(f"<{len(token_ids)}q", *token_ids), salt)


def _hash_packed(parent: BlockHash | None, packed: bytes | memoryview, salt: str | None) -> BlockHash:
    """hash_block over token ids already packed as little-endian int64."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(packed)
    if parent is None and salt is not None:  # the first key carries the salt, and every later key chains it
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], num_tokens: int, block_size: int,
                        salt: str | None = None, start: int = 0) -> None:
    """Append to `hashes` the keys of the full blocks within the first `num_tokens` tokens that it lacks;
    token_ids[j] is token `start + j` (a caller may pass only the tail the missing blocks need)."""
    first, end = len(hashes), num_tokens // block_size
    if first >= end:
        return
    # one conversion of the needed tokens to little-endian int64 bytes (what hash_block packs), then a hash per
    # block over a slice: a 4K-token prompt's keys cost ~0.2 ms instead of ~0.8 ms of per-block packing
    lo = first * block_size - start
    packed = array("q", token_ids[lo:end * block_size - start])
    if sys.byteorder != "little":
        packed.byteswap()
    buf = memoryview(packed).cast("B")
    width = 8 * block_size
    parent = hashes[first - 1] if first else None
    for i in range(end - first):
        parent = _hash_packed(parent, buf[i * width:(i + 1) * width], salt)
        hashes.append(parent)
