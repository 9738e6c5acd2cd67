"""Prefix-cache block hashes: a full block's key chains its parent's key, its token ids and any extra keys
(a request's cache_salt), through SHA-256, so equal keys mean equal prefixes (never Python's `hash()`)."""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes  # a SHA-256 digest (32 bytes)
_ROOT = b"graphrunner-prefix-cache-v1"


def hash_block(parent: BlockHash | None, token_ids: list[int], salt: str | None = None) -> BlockHash:
    """The key of one full block: SHA-256 over (parent key, its token ids, the salt, for the first block)."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if parent is None and salt is not None:  # the first key carries the salt, and every later key chains it
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: list[int], num_tokens: int, block_size: int,
                        salt: str | None = None, start: int = 0) -> None:
    """Append to `hashes` the keys of the full blocks within the first `num_tokens` tokens that it lacks;
    token_ids[j] is token `start + j` (a caller may pass only the tail the missing blocks need)."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else None
        lo = i * block_size - start
        hashes.append(hash_block(parent, token_ids[lo:lo + block_size], salt))
