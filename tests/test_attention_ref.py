"""The PyTorch reference paged attention against dense per-request attention on awkward layouts."""

from __future__ import annotations

import math

import pytest
import torch

from graphrunner.attention.metadata import AttentionMetadata
from graphrunner.attention.reference import paged_attention_ref, write_kv_ref
from graphrunner.attention.testing import contiguous_batch


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q [q, Hq, D] are the last q positions of k/v [s, Hkv, D]."""
    q_len, s_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.double()) * scale
    qp = torch.arange(s_len - q_len, s_len)[:, None]
    kp = torch.arange(s_len)[None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= kp > qp - window
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_reference_matches_dense(block_size: int, window: int | None, hq: int, hkv: int) -> None:
    torch.manual_seed(0)
    d = 16
    # decodes (q=1) and prefill chunks over cached prefixes, mixed in one batch
    query_lens = [1, 5, 1, 17, 2, 1]
    context_lens = [1, 5, block_size + 1, 40, block_size - 1, 3 * block_size]
    meta, cache = contiguous_batch(query_lens, context_lens, 1, hkv, d, block_size, torch.float32, "cpu")
    full_k = [torch.randn(c, hkv, d) for c in context_lens]
    full_v = [torch.randn(c, hkv, d) for c in context_lens]
    # fill the cached prefixes directly, then write this step's tokens through write_kv_ref
    for b, c in enumerate(context_lens):
        for p in range(c - query_lens[b]):
            blk = int(meta.block_table[b, p // block_size])
            cache[0, 0, blk, p % block_size] = full_k[b][p]
            cache[0, 1, blk, p % block_size] = full_v[b][p]
    step_k = torch.cat([k[c - q:] for k, q, c in zip(full_k, query_lens, context_lens)])
    step_v = torch.cat([v[c - q:] for v, q, c in zip(full_v, query_lens, context_lens)])
    write_kv_ref(step_k, step_v, cache[0], meta.slot_mapping)
    q = torch.randn(meta.num_tokens, hq, d)
    scale = d ** -0.5
    out = paged_attention_ref(q, cache[0], meta, scale, window)
    start = 0
    for b, (ql, c) in enumerate(zip(query_lens, context_lens)):
        ref = _dense(q[start:start + ql], full_k[b], full_v[b], scale, window)
        torch.testing.assert_close(out[start:start + ql].double(), ref, atol=1e-5, rtol=1e-5)
        start += ql


def test_write_kv_skips_padding_slots() -> None:
    cache = torch.zeros(2, 3, 4, 1, 2)
    cache[:, 0] = 7.0  # the null block's contents must survive padding writes
    slots = torch.tensor([5, -1, 8, -1])
    k = torch.arange(8.0).view(4, 1, 2)
    write_kv_ref(k, -k, cache, slots)
    flat = cache.view(2, 12, 1, 2)
    torch.testing.assert_close(flat[0, 5], k[0])
    torch.testing.assert_close(flat[1, 8], -k[2])
    assert torch.all(cache[:, 0] == 7.0)
    assert int((flat[0] != 0).any(-1).any(-1).sum()) == 4 + 2  # null block (4 slots) + two real slots


def test_metadata_rejects_inconsistent_host_lists() -> None:
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_reqs"):
        AttentionMetadata(2, 2, 1, 1, 16, z, z, z.view(1, 1), z.long(), query_lens_cpu=[1], seq_lens_cpu=[1])
