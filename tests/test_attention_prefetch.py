"""The key loop's prefetching variant of Triton paged attention (GRAPHRUNNER_ATTN_PREFETCH=1: V and the next tile's
block ids issued together with K) is bit-equal to the plain loop and matches the PyTorch reference, at 32 and 64
keys per iteration, on awkward batches: decode rows, a chunk over a cached prefix in several query tiles, KV
splits, a sliding window, more splits than keys, tiles that end mid-block, and block tables scattered over the
pool; on a GPU an engine gives the same greedy tokens with it on and off, through graphs and eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import attention_with_switch, greedy_tokens_off_and_on, make_tiny_model

from graphrunner.attention import triton_attention
from graphrunner.attention.reference import paged_attention_ref
from graphrunner.attention.testing import contiguous_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("query_lens", "context_lens", "num_splits", "window", "block_size"), [
    ([1, 1, 1], [37, 1, 200], 1, None, 16),  # decode rows, one with a single key
    ([1, 1, 1], [37, 1, 200], 3, None, 16),  # ... split, with empty splits
    ([1, 70], [9, 219], 1, None, 4),  # a 70-token chunk over 149 cached keys: several query tiles, many key tiles
    ([1, 20], [9, 150], 5, None, 16),  # a short chunk over a cached prefix, split like a decode
    ([1, 1], [90, 61], 4, 24, 8),  # sliding window: the loop starts mid-range
    ([1], [3], 7, None, 16),  # more splits than keys
    ([65], [65], 1, None, 16),  # a whole prompt, one key past a tile
])
@pytest.mark.parametrize("tile", [32, 64])  # keys per iteration (GRAPHRUNNER_ATTN_TILE)
def test_prefetching_loop_is_bit_equal_to_the_plain_loop(monkeypatch: pytest.MonkeyPatch, query_lens: list[int],
                                                         context_lens: list[int], num_splits: int,
                                                         window: int | None, block_size: int, tile: int) -> None:
    monkeypatch.setattr(triton_attention, "TILE_N", tile)
    hq, hkv, d = 6, 2, 24  # GQA group 3, head dim not a power of two
    meta, caches = contiguous_batch(query_lens, context_lens, 1, hkv, d, block_size, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(sum(context_lens) + 31 * num_splits + block_size)
    # scatter the requests' blocks over the pool (block 0, the null block, stays put)
    num_blocks = caches.shape[2]
    perm = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(num_blocks - 1, generator=g) + 1])
    meta.block_table.copy_(perm.to(DEVICE)[meta.block_table.long()].to(torch.int32))
    cache = caches[0]
    cache.copy_(torch.randn(cache.shape, generator=g).to(DEVICE))
    query = torch.randn(meta.num_tokens, hq, d, generator=g).to(DEVICE)
    plain = attention_with_switch("PREFETCH_KV", monkeypatch, False, query, cache, meta, num_splits, window)
    prefetched = attention_with_switch("PREFETCH_KV", monkeypatch, True, query, cache, meta, num_splits, window)
    assert torch.equal(prefetched, plain)
    ref = paged_attention_ref(query, cache, meta, d ** -0.5, sliding_window=window)
    torch.testing.assert_close(prefetched, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_engine_tokens_equal_with_prefetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    # contexts past SPLIT_MIN_SEQ_LEN (128), so decode attention splits its KV range; a shared prefix makes the
    # second request a prefix-cache hit (a short chunk over a long cached range)
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 45, [5, 6, 7, 8, 9, 10, 11] * 45 + [3, 4, 5], [3] * 280]
    kwargs = {"dtype": "bfloat16", "max_model_len": 512, "device": "cuda", "enforce_eager": mode == "eager",
              "attention_backend": "triton"}
    tokens = greedy_tokens_off_and_on(monkeypatch, triton_attention, "PREFETCH_KV", model_dir, prompts, 24, **kwargs)
    assert tokens[0] == tokens[1]
