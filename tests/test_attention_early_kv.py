"""Decode attention's early KV loads (GRAPHRUNNER_ATTN_EARLY_KV, on by default with PDL): a decode-only launch reads
its first key tile's rows below ctx - 1 before its PDL wait and the rest after it. The results are bit-equal to the
launch without it and match the PyTorch reference, on decode batches with splits, windows, one key, tiles that end
mid-block; under the interpreter a stand-in wait that only then writes the rows at and after ctx - 1 shows the
kernel takes them from loads after the wait; the rule takes only decode-only launches with PDL and the prefetching
loop.
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.attention import triton_attention
from graphrunner.attention.reference import paged_attention_ref
from graphrunner.attention.testing import contiguous_batch
from graphrunner.kernel_checks import interpreted

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_PDL_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _force_pdl(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setattr(triton_attention, "use_pdl", lambda _device: on and (DEVICE == "cpu" or _PDL_CAPABLE))


def _batch(context_lens: list[int], hkv: int, d: int, block_size: int, seed: int
           ) -> tuple[object, torch.Tensor, torch.Tensor]:
    meta, caches = contiguous_batch([1] * len(context_lens), context_lens, 1, hkv, d, block_size, torch.float32,
                                    DEVICE)
    g = torch.Generator().manual_seed(seed)
    num_blocks = caches.shape[2]  # scatter the blocks (block 0, the null block, stays put)
    perm = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(num_blocks - 1, generator=g) + 1])
    meta.block_table.copy_(perm.to(DEVICE)[meta.block_table.long()].to(torch.int32))
    cache = caches[0]
    cache.copy_(torch.randn(cache.shape, generator=g).to(DEVICE))
    query = torch.randn(meta.num_tokens, 2 * hkv, d, generator=g).to(DEVICE)
    return meta, cache, query


@pytest.mark.parametrize(("context_lens", "num_splits", "window", "block_size"), [
    ([37, 1, 200], 1, None, 16),  # one request with a single key (all of it read after the wait)
    ([37, 1, 200], 3, None, 16),  # split, with empty splits
    ([2, 63, 64, 65, 129], 2, None, 8),  # ctx - 1 on either side of a tile's end
    ([90, 61], 4, 24, 8),  # sliding window: the first tile starts mid-range
    ([3], 7, None, 16),  # more splits than keys
    ([150, 77], 1, None, 4),  # several tiles after the early one
])
@pytest.mark.parametrize("early_v", [True, False])  # V before the wait too, or only K
def test_early_kv_is_bit_equal_and_matches_the_reference(monkeypatch: pytest.MonkeyPatch, context_lens: list[int],
                                                         num_splits: int, window: int | None, block_size: int,
                                                         early_v: bool) -> None:
    if DEVICE == "cuda" and not _PDL_CAPABLE:
        pytest.skip("PDL needs compute capability 9.0 or more")
    hkv, d = 2, 24  # GQA group 2, head dim not a power of two
    meta, cache, query = _batch(context_lens, hkv, d, block_size, sum(context_lens) + num_splits)
    outs = []
    _force_pdl(monkeypatch, True)
    monkeypatch.setattr(triton_attention, "EARLY_V", early_v)
    for on in (False, True):
        monkeypatch.setattr(triton_attention, "EARLY_KV", on)
        outs.append(triton_attention.unified_attention(query, cache, meta, d ** -0.5, sliding_window=window,
                                                       num_splits=num_splits, out=torch.empty_like(query)))
    assert torch.equal(outs[0], outs[1])
    ref = paged_attention_ref(query, cache, meta, d ** -0.5, sliding_window=window)
    torch.testing.assert_close(outs[1], ref, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(DEVICE != "cpu" or not interpreted(), reason="the stand-in wait runs under the interpreter")
@pytest.mark.parametrize("context_len", [1, 2, 3, 40, 64, 65, 66, 130])
@pytest.mark.parametrize("early_v", [True, False])
def test_rows_from_ctx_minus_one_are_read_only_after_the_wait(monkeypatch: pytest.MonkeyPatch, context_len: int,
                                                              early_v: bool) -> None:
    """One request, one KV head, one split: a single program. Its rows at positions >= ctx - 1 (ctx = context_len
    - 1) hold NaN until the wait; the stand-in wait writes their values, as the kernel before it would. If the kernel
    used a load of them from before the wait, the output would be NaN."""
    block_size, d = 8, 16
    meta, cache, query = _batch([context_len], 1, d, block_size, context_len)
    ref = paged_attention_ref(query, cache, meta, d ** -0.5)
    table = meta.block_table[0].long()
    late = [int(table[p // block_size]) * block_size + p % block_size for p in range(max(context_len - 2, 0),
                                                                                      context_len)]
    flat = cache.view(2, -1, 1, d)  # [2, slots, Hkv, D]
    values = flat[:, late].clone()
    flat[:, late] = float("nan")
    waits = []

    def wait() -> None:  # the interpreter calls it as plain Python, between the program's loads
        waits.append(True)
        flat[:, late] = values

    _force_pdl(monkeypatch, True)
    monkeypatch.setattr(triton_attention, "EARLY_KV", True)
    monkeypatch.setattr(triton_attention, "EARLY_V", early_v)
    monkeypatch.setattr(triton_attention, "pdl_wait", wait)
    out = triton_attention.unified_attention(query, cache, meta, d ** -0.5, out=torch.empty_like(query))
    assert waits == [True]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_only_decode_only_launches_with_pdl_and_prefetch_load_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_attention, "EARLY_KV", True)
    monkeypatch.setattr(triton_attention, "PREFETCH_KV", True)
    assert triton_attention.early_kv(True, 1) and triton_attention.early_kv(True, 0)
    assert not triton_attention.early_kv(True, 2)  # a verify step or a prefill chunk: its own rows are fresh
    assert not triton_attention.early_kv(False, 1)
    monkeypatch.setattr(triton_attention, "PREFETCH_KV", False)
    assert not triton_attention.early_kv(True, 1)
    monkeypatch.setattr(triton_attention, "PREFETCH_KV", True)
    monkeypatch.setattr(triton_attention, "EARLY_KV", False)
    assert not triton_attention.early_kv(True, 1)
