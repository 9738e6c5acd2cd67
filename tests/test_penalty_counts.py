"""Tests for graphrunner.penalty_counts and the count update fused into state_kernels.post_update: the admission fill
(Triton == PyTorch reference == a plain-Python count) on awkward sizes, the verify-step hook, and post_update's
counts (Triton == reference == Python) including rows without penalties, partial prefill chunks and full rows.

Runs on CUDA when available, else on CPU with Triton in interpreter mode.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from graphrunner.penalty_counts import (
    PenaltyCounts,
    add_output_counts,
    fill_counts,
    fill_counts_ref,
    fill_counts_triton,
    mask_words,
)
from graphrunner.state_kernels import post_update

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params(num_rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row parameters: every third row neutral, the others using one or more penalties."""
    rep = torch.tensor([1.0, 1.2, 1.0])[torch.arange(num_rows) % 3]
    pres = torch.tensor([0.0, 0.0, 0.5])[torch.arange(num_rows) % 3]
    freq = torch.tensor([0.0, 0.3, 0.0])[torch.randint(0, 3, (num_rows,), generator=g)]
    freq[torch.arange(num_rows) % 3 == 0] = 0.0
    return rep.to(DEVICE), pres.to(DEVICE), freq.to(DEVICE)


def _python_stats(token_ids: list[int], prompt_len: int, num_tokens: int, vocab: int) -> tuple[list[int], list[int]]:
    hist = token_ids[:num_tokens]
    counts = Counter(t for t in hist[prompt_len:] if 0 <= t < vocab)
    words = [0] * mask_words(vocab)
    for t in hist[:prompt_len]:
        if 0 <= t < vocab:
            words[t // 32] |= 1 << (t % 32)
    signed = [w - 2**32 if w >= 2**31 else w for w in words]
    return [counts.get(v, 0) for v in range(vocab)], signed


@pytest.mark.parametrize("vocab", [1, 31, 32, 999, 4097])
@pytest.mark.parametrize("num_fill", [0, 1, 5])
def test_fill_triton_ref_python_agree(vocab: int, num_fill: int) -> None:
    g = torch.Generator().manual_seed(vocab * 10 + num_fill)
    num_rows, max_len = 7, 45
    token_ids = torch.randint(-2, vocab + 2, (num_rows, max_len), generator=g, dtype=torch.int32)  # some invalid ids
    token_ids[:, ::3] = torch.randint(0, min(vocab, 5), (num_rows, 15), generator=g, dtype=torch.int32)  # repeats
    prompt_len = torch.randint(0, max_len + 1, (num_rows,), generator=g, dtype=torch.int32)
    num_tokens = torch.minimum(prompt_len + torch.randint(0, 20, (num_rows,), generator=g, dtype=torch.int32),
                               torch.tensor(max_len + 3))  # beyond the row: clamped
    prompt_len[0], num_tokens[0] = 0, 0  # empty history
    prompt_len[1], num_tokens[1] = 9, 9  # a prompt, no outputs
    rows = torch.randperm(num_rows, generator=g)[:num_fill].to(torch.int32)
    results = []
    for fn in (fill_counts_ref, fill_counts_triton):
        counts = torch.full((num_rows, vocab), 77, dtype=torch.int32, device=DEVICE)  # stale values
        mask = torch.full((num_rows, mask_words(vocab)), -3, dtype=torch.int32, device=DEVICE)
        fn(rows.to(DEVICE), token_ids.to(DEVICE), prompt_len.to(DEVICE), num_tokens.to(DEVICE), counts, mask)
        results.append((counts.cpu(), mask.cpu()))
    for r in range(num_rows):
        if r in rows.tolist():
            c, m = _python_stats(token_ids[r].tolist(), int(prompt_len[r]), int(num_tokens[r]), vocab)
            expected_counts, expected_mask = torch.tensor(c, dtype=torch.int32), torch.tensor(m, dtype=torch.int32)
        else:  # rows not named are left alone
            expected_counts = torch.full((vocab,), 77, dtype=torch.int32)
            expected_mask = torch.full((mask_words(vocab),), -3, dtype=torch.int32)
        for counts, mask in results:
            assert torch.equal(counts[r], expected_counts), r
            assert torch.equal(mask[r], expected_mask), r


def test_fill_bit_31_and_long_history() -> None:
    """The sign bit of a mask word (id 31, 63, ...) and a history longer than one pass of all fill programs."""
    vocab, max_len = 64, 512 * 32 + 300
    token_ids = torch.arange(max_len, dtype=torch.int32).remainder(vocab)[None, :].repeat(2, 1)
    token_ids[1, :5] = torch.tensor([31, 63, 31, 0, 0])
    prompt_len = torch.tensor([max_len - 2, 5], dtype=torch.int32)
    num_tokens = torch.tensor([max_len, max_len], dtype=torch.int32)
    rows = torch.tensor([1, 0], dtype=torch.int32)
    for use_triton in (False, True):
        rep = torch.ones(2, device=DEVICE)
        pen = PenaltyCounts.allocate(2, vocab, rep, torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE))
        fill_counts(rows.to(DEVICE), token_ids.to(DEVICE), prompt_len.to(DEVICE), num_tokens.to(DEVICE), pen,
                    use_triton)
        for r in range(2):
            c, m = _python_stats(token_ids[r].tolist(), int(prompt_len[r]), max_len, vocab)
            assert pen.output_counts[r].cpu().tolist() == c
            assert pen.prompt_mask[r].cpu().tolist() == m
        assert pen.prompt_mask[1].cpu().tolist() == [(1 << 31) - 2**32 + 1, (1 << 31) - 2**32]


def test_fill_validation() -> None:
    i32 = {"dtype": torch.int32, "device": DEVICE}
    args = [torch.zeros(1, **i32), torch.zeros(2, 4, **i32), torch.zeros(2, **i32), torch.zeros(2, **i32),
            torch.zeros(2, 40, **i32), torch.zeros(2, 2, **i32)]
    bad = list(args)
    bad[5] = torch.zeros(2, 1, **i32)
    with pytest.raises(ValueError, match="prompt_mask has 1 words a row, a vocabulary of 40 needs 2"):
        fill_counts_ref(*bad)
    bad = list(args)
    bad[2] = torch.zeros(3, **i32)
    with pytest.raises(ValueError, match="prompt_len has 3 rows, token_ids has 2"):
        fill_counts_triton(*bad)
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        PenaltyCounts.allocate(2, 0, torch.ones(2), torch.zeros(2), torch.zeros(2))


@pytest.mark.parametrize("num_reqs", [0, 1, 6])
@pytest.mark.parametrize("use_triton", [False, True])
def test_post_update_counts_appended_tokens_of_penalised_rows(num_reqs: int, use_triton: bool) -> None:
    """Counts follow the history: +1 for the appended token of a row with a penalty; nothing for neutral rows,
    partial prefill chunks (no append), full rows, or ids outside the vocabulary."""
    g = torch.Generator().manual_seed(num_reqs)
    num_rows, max_len, vocab = 9, 20, 37
    rep, pres, freq = _params(num_rows, g)
    pen = PenaltyCounts.allocate(num_rows, vocab, rep, pres, freq)
    pen.output_counts.copy_(torch.randint(0, 3, (num_rows, vocab), generator=g, dtype=torch.int32).to(DEVICE))
    before = pen.output_counts.clone()
    token_ids = torch.zeros(num_rows, max_len, dtype=torch.int32, device=DEVICE)
    num_tokens = torch.randint(1, max_len + 1, (num_rows,), generator=g, dtype=torch.int32)
    num_tokens[0] = max_len  # a full row never appends
    num_computed = (num_tokens - torch.randint(1, 4, (num_rows,), generator=g, dtype=torch.int32)).clamp(min=0)
    idx = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    sched = torch.randint(1, 4, (num_reqs,), generator=g, dtype=torch.int32)  # some do not reach num_tokens
    sampled = torch.randint(0, vocab, (num_reqs,), generator=g, dtype=torch.int32)
    if num_reqs:
        sampled[0] = vocab + 4  # an id outside the vocabulary: appended to the history, never counted
    nt_before = num_tokens.clone()
    nt_dev, nc_dev = num_tokens.to(DEVICE), num_computed.to(DEVICE)
    post_update(idx.to(DEVICE), sched.to(DEVICE), sampled.to(DEVICE), token_ids, nc_dev, nt_dev, use_triton, pen)
    expected = before.cpu().clone()
    for b, r in enumerate(idx.tolist()):
        appended = int(nt_dev[r]) == int(nt_before[r]) + 1
        assert appended == (int(num_computed[r]) + int(sched[b]) >= int(nt_before[r]) and int(nt_before[r]) < max_len)
        active = float(rep[r]) != 1.0 or float(pres[r]) != 0.0 or float(freq[r]) != 0.0
        if appended and active and 0 <= int(sampled[b]) < vocab:
            expected[r, int(sampled[b])] += 1
    assert torch.equal(pen.output_counts.cpu(), expected)
    if num_reqs == 6:
        assert not torch.equal(expected, before.cpu())  # the case counted something


@pytest.mark.parametrize("width", [1, 4])
def test_add_output_counts_matches_python(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    num_rows, vocab, b = 8, 29, 5
    rep, pres, freq = _params(num_rows, g)
    pen = PenaltyCounts.allocate(num_rows, vocab, rep, pres, freq)
    idx = torch.randperm(num_rows, generator=g)[:b].to(torch.int32)
    tokens = torch.randint(0, 3, (b, width), generator=g, dtype=torch.int32)  # repeats within a run
    tokens[0, -1] = -1  # the unused slots of a run hold -1
    num_new = torch.randint(0, width + 1, (b,), generator=g)
    add_output_counts(idx.to(DEVICE), tokens.to(DEVICE), num_new.to(DEVICE), pen)
    expected = torch.zeros(num_rows, vocab, dtype=torch.int32)
    for i, r in enumerate(idx.tolist()):
        if float(rep[r]) != 1.0 or float(pres[r]) != 0.0 or float(freq[r]) != 0.0:
            for t in tokens[i, : int(num_new[i])].tolist():
                if 0 <= t < vocab:
                    expected[r, t] += 1
    assert torch.equal(pen.output_counts.cpu(), expected)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    add_output_counts(empty, torch.zeros(0, width, dtype=torch.int32, device=DEVICE), empty, pen)  # no rows: no-op
    assert torch.equal(pen.output_counts.cpu(), expected)
