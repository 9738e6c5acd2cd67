"""Tests for graphrunner.sampling.penalties over the persistent statistics of graphrunner.penalty_counts: filled from
a history (Triton or reference), the apply kernel == its PyTorch reference == the recounting reference == a
plain-Python loop on awkward sizes; repetition == Hugging Face's RepetitionPenaltyLogitsProcessor, presence/frequency
== the direct formula.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (there Triton and reference agree bit for bit).
"""

from __future__ import annotations

import inspect
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from graphrunner import penalty_counts
from graphrunner.penalty_counts import PenaltyCounts, fill_counts
from graphrunner.sampling import penalties
from graphrunner.sampling.penalties import (
    apply_penalties,
    apply_penalties_history_ref,
    apply_penalties_ref,
    apply_penalties_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


def _from_counts(fill_triton: bool, apply_triton: bool):
    """An implementation with the recounting reference's signature: fill the statistics of every row from the
    history, then apply from them."""

    def fn(logits, idx, token_ids, prompt_len, num_tokens, rep, pres, freq) -> None:
        pen = PenaltyCounts.allocate(token_ids.shape[0], logits.shape[1], rep, pres, freq)
        pen.output_counts.fill_(-5)  # stale values of a previous owner must be overwritten
        pen.prompt_mask.fill_(-1)
        rows = torch.arange(token_ids.shape[0], dtype=torch.int32, device=logits.device)
        fill_counts(rows, token_ids, prompt_len, num_tokens, pen, fill_triton)
        apply = apply_penalties_triton if apply_triton else apply_penalties_ref
        apply(logits, idx, pen.output_counts, pen.prompt_mask, rep, pres, freq)

    return fn


IMPLS = [apply_penalties_history_ref, _from_counts(False, False), _from_counts(True, True),
         _from_counts(False, True), _from_counts(True, False)]


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact on CPU (interpreter: numpy float32); on CUDA allow one ulp for safety."""
    tol = 1e-6 if DEVICE == "cuda" else 0.0
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=tol, rtol=tol, equal_nan=True)


def _state(num_reqs: int, vocab: int, seed: int, max_len: int = 48, neutral_every: int = 4):
    """Random logits (with -inf entries) and a state table of R = num_reqs + 4 rows addressed by a shuffled mapping.

    Histories draw from a small pool (many repeats) mixed with the whole vocab; positions past num_tokens hold
    garbage ids that must be ignored. Rows cover: empty outputs, empty history, full history, neutral parameters.
    """
    g = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + 4
    logits = torch.randn(num_reqs, vocab, generator=g) * 3
    logits[torch.rand(num_reqs, vocab, generator=g) < 0.1] = NEG_INF
    idx = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    pool = torch.randint(0, vocab, (num_rows, max_len), generator=g)
    small = torch.randint(0, min(vocab, 12), (num_rows, max_len), generator=g)
    token_ids = torch.where(torch.rand(num_rows, max_len, generator=g) < 0.7, small, pool).to(torch.int32)
    prompt_len = torch.randint(0, max_len + 1, (num_rows,), generator=g, dtype=torch.int32)
    num_tokens = prompt_len + (torch.rand(num_rows, generator=g) * (max_len + 1 - prompt_len)).to(torch.int32)
    num_tokens[0] = prompt_len[0]  # no outputs yet
    prompt_len[1], num_tokens[1] = 0, 0  # empty history
    prompt_len[2], num_tokens[2] = 5, max_len  # full history
    rep = torch.tensor([1.0, 1.3, 0.6, 2.0])[torch.randint(0, 4, (num_rows,), generator=g)]
    pres = torch.tensor([0.0, 0.5, -0.7, 2.0])[torch.randint(0, 4, (num_rows,), generator=g)]
    freq = torch.tensor([0.0, 0.25, -1.0, 1.5])[torch.randint(0, 4, (num_rows,), generator=g)]
    neutral = torch.arange(num_rows) % neutral_every == 3
    rep[neutral], pres[neutral], freq[neutral] = 1.0, 0.0, 0.0
    tables = [t.to(DEVICE) for t in (token_ids, prompt_len, num_tokens, rep, pres, freq)]
    return logits.to(DEVICE), idx.to(DEVICE), tables


def _python_penalties(logits: torch.Tensor, idx: torch.Tensor, tables: list[torch.Tensor]) -> torch.Tensor:
    """The plain-Python oracle: per row, per vocab id, float32 scalar arithmetic (numpy) on lists."""
    token_ids, prompt_len, num_tokens, rep, pres, freq = (t.cpu().tolist() for t in tables)
    out = logits.cpu().clone()
    vocab = out.shape[1]
    for b, r in enumerate(idx.cpu().tolist()):
        if rep[r] == 1.0 and pres[r] == 0.0 and freq[r] == 0.0:
            continue
        hist = [t for t in token_ids[r][: num_tokens[r]]]
        seen = {t for t in hist if 0 <= t < vocab}
        count = Counter(t for t in hist[prompt_len[r]:] if 0 <= t < vocab)
        row = out[b].tolist()
        f_rep, f_pres, f_freq = np.float32(rep[r]), np.float32(pres[r]), np.float32(freq[r])
        for v in range(vocab):
            x = np.float32(row[v])
            if v in seen:
                x = x / f_rep if x > 0 else x * f_rep
            c = count.get(v, 0)
            x = x - (f_freq * np.float32(c) + f_pres * np.float32(c > 0))
            row[v] = float(x)
        out[b] = torch.tensor(row, dtype=torch.float32)
    return out


@pytest.mark.parametrize("vocab", [1, 999, 1024, 4097])
@pytest.mark.parametrize("num_reqs", [0, 1, 5])
def test_triton_ref_python_agree(num_reqs: int, vocab: int) -> None:
    logits, idx, tables = _state(num_reqs, vocab, seed=1000 * num_reqs + vocab)
    expected = _python_penalties(logits, idx, tables)
    rows = idx.long().cpu()
    neutral = (tables[3].cpu()[rows] == 1) & (tables[4].cpu()[rows] == 0) & (tables[5].cpu()[rows] == 0)
    for fn in IMPLS:
        out = logits.clone()
        fn(out, idx, *tables)
        _assert_same(out, expected)
        assert torch.equal(out.cpu()[neutral].view(torch.int32), logits.cpu()[neutral].view(torch.int32))
        assert torch.equal(torch.isneginf(out), torch.isneginf(logits))  # -inf stays -inf, nothing else becomes it
    if num_reqs == 5 and vocab > 1:
        assert not torch.equal(expected, logits.cpu())  # the case actually penalises something


def test_dispatcher_and_strided_logits() -> None:
    """A [B, V] view into a wider buffer is updated in place; the columns beyond V are not touched."""
    logits, idx, tables = _state(4, 300, seed=7, neutral_every=2)
    token_ids, prompt_len, num_tokens, rep, pres, freq = tables
    expected = _python_penalties(logits, idx, tables)
    for use_triton in (False, True):
        pen = PenaltyCounts.allocate(token_ids.shape[0], 300, rep, pres, freq)
        rows = torch.arange(token_ids.shape[0], dtype=torch.int32, device=DEVICE)
        fill_counts(rows, token_ids, prompt_len, num_tokens, pen, use_triton)
        buf = torch.full((4, 305), 123.0, device=DEVICE)
        buf[:, :300] = logits
        apply_penalties(buf[:, :300], idx, pen, use_triton=use_triton)
        _assert_same(buf[:, :300], expected)
        assert bool((buf[:, 300:] == 123.0).all())


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_matches_hf(penalty: float) -> None:
    """HF penalises every id of input_ids (prompt + output) once: same as ours with presence = frequency = 0."""
    g = torch.Generator().manual_seed(int(penalty * 100))
    num_reqs, num_rows, vocab, hist_len, max_len = 4, 7, 257, 30, 40
    logits = torch.randn(num_reqs, vocab, generator=g) * 4
    logits[:, ::11] = NEG_INF
    idx = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    token_ids = torch.randint(0, 40, (num_rows, max_len), generator=g, dtype=torch.int32)
    prompt_len = torch.randint(0, hist_len + 1, (num_rows,), generator=g, dtype=torch.int32)
    num_tokens = torch.full((num_rows,), hist_len, dtype=torch.int32)
    rep = torch.full((num_rows,), penalty)
    zeros = torch.zeros(num_rows)
    hf = RepetitionPenaltyLogitsProcessor(penalty=penalty)(token_ids[idx.long(), :hist_len].long(), logits.clone())
    tables = [t.to(DEVICE) for t in (token_ids, prompt_len, num_tokens, rep, zeros, zeros)]
    for fn in IMPLS:
        out = logits.clone().to(DEVICE)
        fn(out, idx.to(DEVICE), *tables)
        _assert_same(out, hf)


@pytest.mark.parametrize("seed", [0, 1])
def test_presence_frequency_direct_formula(seed: int) -> None:
    """repetition = 1: logits - frequency * bincount(outputs) - presence * (bincount(outputs) > 0), prompt ignored."""
    logits, idx, tables = _state(5, 777, seed=seed, neutral_every=100)
    token_ids, prompt_len, num_tokens, rep, pres, freq = (t.cpu() for t in tables)
    rep.fill_(1.0)
    expected = logits.cpu().clone()
    for b, r in enumerate(idx.cpu().tolist()):
        counts = torch.bincount(token_ids[r, prompt_len[r]: num_tokens[r]].long(), minlength=777).float()
        expected[b] = expected[b] - freq[r] * counts - pres[r] * (counts > 0).float()
    tables[3] = rep.to(DEVICE)
    for fn in IMPLS:
        out = logits.clone()
        fn(out, idx, *tables)
        torch.testing.assert_close(out.cpu(), expected, equal_nan=True)


def test_long_history_and_out_of_vocab_ids() -> None:
    """A history longer than all counting programs cover in one pass; ids outside [0, V) are ignored."""
    vocab, max_len = 50, penalty_counts._BLOCK_L * penalty_counts._MAX_CHUNKS + 700
    g = torch.Generator().manual_seed(3)
    token_ids = torch.randint(-3, vocab + 3, (3, max_len), generator=g, dtype=torch.int32)
    token_ids[1, -1] = 7  # the last position of a full row counts
    prompt_len = torch.tensor([100, max_len - 300, 9000], dtype=torch.int32)
    num_tokens = torch.tensor([max_len - 5, max_len + 9, 9000], dtype=torch.int32)  # > L is clamped to L
    rep, pres, freq = torch.tensor([1.5, 1.0, 0.8]), torch.tensor([0.1, 0.3, 0.0]), torch.tensor([0.01, 0.02, 0.0])
    tables = [t.to(DEVICE) for t in (token_ids, prompt_len, num_tokens, rep, pres, freq)]
    logits = (torch.randn(3, vocab, generator=g) * 5).to(DEVICE)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    expected = _python_penalties(logits, idx, tables)
    for fn in IMPLS:
        out = logits.clone()
        fn(out, idx, *tables)
        _assert_same(out, expected)


def test_neutral_rows_bit_identical_and_shared_rows() -> None:
    """NaN / -0.0 / inf payloads of neutral rows survive bit for bit; two batch rows may map to one state row."""
    vocab = 33
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), NEG_INF, 1e-38])
    logits = torch.randn(4, vocab)
    logits[:, : len(special)] = special
    token_ids = torch.arange(40, dtype=torch.int32).remainder(vocab).repeat(3, 1)
    prompt_len, num_tokens = torch.tensor([3, 3, 3], dtype=torch.int32), torch.tensor([40, 40, 40], dtype=torch.int32)
    rep, pres, freq = torch.tensor([1.0, 1.2, 1.0]), torch.tensor([0.0, 0.4, 0.0]), torch.tensor([0.0, 0.3, 0.0])
    idx = torch.tensor([0, 1, 2, 1], dtype=torch.int32, device=DEVICE)
    tables = [t.to(DEVICE) for t in (token_ids, prompt_len, num_tokens, rep, pres, freq)]
    logits[3] = logits[1]
    expected = _python_penalties(logits, idx, tables)
    for fn in IMPLS:
        out = logits.clone().to(DEVICE)
        fn(out, idx, *tables)
        for b in (0, 2):
            assert torch.equal(out[b].cpu().view(torch.int32), logits[b].view(torch.int32))
        _assert_same(out, expected)
        assert torch.equal(out[1].cpu().view(torch.int32), out[3].cpu().view(torch.int32))


def test_source_has_no_host_sync() -> None:
    for module in (penalties, penalty_counts):
        src = inspect.getsource(module)
        for bad in (".item(", ".tolist(", ".cpu(", "nonzero", "synchronize", "masked_select"):
            assert bad not in src, bad


@pytest.mark.parametrize(
    "pos, bad, match",
    [
        (0, torch.zeros(2, 5, dtype=torch.float16), "logits must be torch.float32"),
        (0, torch.zeros(2, 5, 1), "logits must be 2-D"),
        (0, torch.zeros(2, 6), "output_counts covers a vocabulary of 5, logits have 6 columns"),
        (1, torch.zeros(3, dtype=torch.int32), "idx_mapping has 3 entries, logits has 2 rows"),
        (1, torch.zeros(2, dtype=torch.int64), "idx_mapping must be torch.int32"),
        (2, torch.zeros(4, 5, dtype=torch.int64), "output_counts must be torch.int32"),
        (3, torch.zeros(4, 2, dtype=torch.int32), r"prompt_mask must be \[4, 1\]"),
        (4, torch.ones(4, dtype=torch.float64), "repetition must be torch.float32"),
        (5, torch.zeros(5), "presence has 5 entries"),
        (6, torch.zeros(4, 1), "frequency must be 1-D"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_validation(pos: int, bad: torch.Tensor, match: str, use_triton: bool) -> None:
    args = [torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), torch.zeros(4, 5, dtype=torch.int32),
            torch.zeros(4, 1, dtype=torch.int32), torch.ones(4), torch.zeros(4), torch.zeros(4)]
    args[pos] = bad
    fn = apply_penalties_triton if use_triton else apply_penalties_ref
    with pytest.raises(ValueError, match=match):
        fn(*(a.to(DEVICE) for a in args))
