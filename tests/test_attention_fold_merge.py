"""The folded split merge of Triton decode attention (GRAPHRUNNER_ATTN_FOLD_MERGE=1): the last split program of each
tile merges the splits itself, and its output is bit-equal to the separate merge kernel's, on awkward batches
(decode rows, a multi-tile chunk over a cached prefix, a sliding window, more splits than keys), launch after
launch (the arrival counters reset themselves); it falls back to the merge kernel when it cannot take a counter;
on a GPU an engine gives the same greedy tokens with it on and off, through graphs and eager.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from tiny_models import attention_with_switch, greedy_tokens_off_and_on, make_tiny_model

from graphrunner.attention import triton_attention
from graphrunner.attention.testing import contiguous_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
fold = partial(attention_with_switch, "FOLD_MERGE")


@pytest.mark.parametrize(("query_lens", "context_lens", "num_splits", "window"), [
    ([1, 1, 1], [37, 1, 200], 3, None),  # decode rows; one request with a single key (empty splits)
    ([1, 20], [9, 150], 5, None),  # a 20-token chunk over 130 cached tokens: several query tiles
    ([1, 1], [90, 61], 4, 24),  # sliding window
    ([1], [3], 7, None),  # more splits than keys
])
def test_folded_merge_is_bit_equal_to_the_merge_kernel(monkeypatch: pytest.MonkeyPatch, query_lens: list[int],
                                                      context_lens: list[int], num_splits: int,
                                                      window: int | None) -> None:
    hq, hkv, d, block_size = 6, 2, 24, 4  # GQA group 3, head dim not a power of two
    meta, caches = contiguous_batch(query_lens, context_lens, 1, hkv, d, block_size, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(sum(context_lens) + num_splits)
    cache = caches[0]
    cache.copy_(torch.randn(cache.shape, generator=g).to(DEVICE))
    query = torch.randn(meta.num_tokens, hq, d, generator=g).to(DEVICE)
    expected = fold(monkeypatch, False, query, cache, meta, num_splits, window)
    for _ in range(2):  # the second launch finds the counters zeroed again
        assert torch.equal(fold(monkeypatch, True, query, cache, meta, num_splits, window), expected)
    counters = triton_attention._counters.get(query.device)  # keyed by the tensors' device (cuda:0, not cuda)
    assert counters is not None and not counters.any()


def test_falls_back_to_the_merge_kernel_without_a_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    meta, caches = contiguous_batch([1, 1], [40, 70], 1, 2, 16, 4, torch.float32, DEVICE)
    g = torch.Generator().manual_seed(7)
    cache = caches[0]
    cache.copy_(torch.randn(cache.shape, generator=g).to(DEVICE))
    query = torch.randn(meta.num_tokens, 4, 16, generator=g).to(DEVICE)
    expected = fold(monkeypatch, False, query, cache, meta, 3, None)
    merges = []
    original = triton_attention._merge_splits_kernel

    class Counting:
        def __getitem__(self, grid: object) -> object:
            merges.append(grid)
            return original[grid]

    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", Counting())
    monkeypatch.setattr(triton_attention, "_counter_buffer", lambda device, tiles: None)  # e.g. too many tiles
    assert torch.equal(fold(monkeypatch, True, query, cache, meta, 3, None), expected) and len(merges) == 1
    monkeypatch.undo()
    monkeypatch.setattr(triton_attention, "_merge_splits_kernel", Counting())
    assert torch.equal(fold(monkeypatch, True, query, cache, meta, 3, None), expected) and len(merges) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_engine_tokens_equal_with_the_folded_merge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    # contexts past SPLIT_MIN_SEQ_LEN (128), so decode attention splits its KV range
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 45, [100, 7, 8, 9, 10] * 60, [3] * 280]
    kwargs = {"dtype": "bfloat16", "max_model_len": 512, "device": "cuda", "enforce_eager": mode == "eager",
              "attention_backend": "triton"}
    tokens = greedy_tokens_off_and_on(monkeypatch, triton_attention, "FOLD_MERGE", model_dir, prompts, 24, **kwargs)
    assert tokens[0] == tokens[1]
