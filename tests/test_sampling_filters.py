"""Tests for graphrunner.sampling.filters: Triton vs PyTorch reference vs a plain-Python (sorted list) oracle of the
min_p -> top_k -> top_p semantics (ties kept), edge cases, validation, and a chi-square test of filtered sampling.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (slow: the Triton batches stay small there).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from graphrunner.sampling.filters import _KEY_NEG_INF, apply_filters, apply_filters_ref, apply_filters_triton
from graphrunner.sampling.gumbel import sample_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")
P_THRESHOLD = 1e-3  # goodness-of-fit tests fail below this p-value; inputs are fixed, so the outcome is deterministic
MARGIN = 2e-6  # the oracle calls a row ill-conditioned when a float32 rounding this size could flip a boundary token

# (top_k, top_p, min_p) per state-table row; "V-1" / "V" / "V+9" are resolved against the vocab size.
SETTINGS: list[tuple[int | str, float, float]] = [
    (0, 1.0, 0.0),  # all off
    (1, 1.0, 0.0),
    ("V-1", 1.0, 0.0),
    ("V", 1.0, 0.0),  # k >= V: off
    ("V+9", 1.0, 0.0),
    (0, 1e-7, 0.0),  # tiny top_p: the argmax (and its ties) only
    (0, 0.5, 0.0),
    (0, 0.999, 0.0),
    (0, 1.0, 1.0),  # min_p 1: the argmax and its ties
    (0, 1.0, 0.05),
    (20, 0.9, 0.0),
    (50, 0.8, 0.02),
    (7, 1.0, 0.1),
    (0, 0.7, 0.01),
    ("V-1", 0.999, 1e-4),
    (3, 0.5, 1.0),
]


def _tables(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ks = [eval(k, {"V": vocab}) if isinstance(k, str) else k for k, _, _ in SETTINGS]
    return (torch.tensor(ks, dtype=torch.int32, device=DEVICE),
            torch.tensor([p for _, p, _ in SETTINGS], dtype=torch.float32, device=DEVICE),
            torch.tensor([m for _, _, m in SETTINGS], dtype=torch.float32, device=DEVICE))


def _logits(num_reqs: int, vocab: int, seed: int) -> torch.Tensor:
    """Gaussian logits; every third row has ~30% -inf entries, every other row is quantised (many ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_reqs, vocab, generator=g) * 3
    for b in range(num_reqs):
        if b % 2 == 1:
            x[b] = torch.round(x[b] * 2) / 2
        if b % 3 == 0 and vocab > 1:
            x[b].masked_fill_(torch.rand(vocab, generator=g) < 0.3, NEG_INF)
    return x.to(DEVICE)


def _py_kept(row: list[float], k: int, p: float, mp: float) -> tuple[set[int], bool]:
    """The semantics on a Python list (float64): kept indices, and whether every boundary has a clear margin."""
    kept = [v for v, x in enumerate(row) if x != NEG_INF]
    clear = True
    if not kept:
        return set(), clear
    m = max(row[v] for v in kept)
    if mp > 0:  # min_p: p[v] >= min_p * p_max  <=>  x >= m + log(min_p)
        thr = m + math.log(min(mp, 1.0))
        clear &= mp >= 1.0 or all(abs(row[v] - thr) > MARGIN * max(1.0, abs(thr)) for v in kept)
        kept = [v for v in kept if row[v] >= thr]
    if 0 < k < len(row) and k <= len(kept):  # top_k: keep values >= the k-th largest
        kth = sorted((row[v] for v in kept), reverse=True)[k - 1]
        kept = [v for v in kept if row[v] >= kth]
    if p < 1.0:  # top_p: the smallest top set (by value, ties together) holding >= p of the renormalised mass
        w = {v: math.exp(row[v] - m) for v in kept}
        z = sum(w.values())
        cum = 0.0
        for t in sorted({row[v] for v in kept}, reverse=True):
            prev, cum = cum, cum + sum(w[v] for v in kept if row[v] == t)
            if cum >= p * z:
                clear &= abs(cum - p * z) > MARGIN * z and (prev == 0.0 or abs(prev - p * z) > MARGIN * z)
                break
        kept = [v for v in kept if row[v] >= t]
    return set(kept), clear


def _kept(x: torch.Tensor) -> list[set[int]]:
    return [{v for v, val in enumerate(r) if val != NEG_INF} for r in x.cpu().tolist()]


def _check_all_paths(logits: torch.Tensor, idx: torch.Tensor, top_k, top_p, min_p) -> list[set[int]]:
    """Reference, Triton and the oracle agree on every row (bit-equal outputs); returns the kept sets."""
    ref, tri = logits.clone(), logits.clone()
    apply_filters_ref(ref, idx, top_k, top_p, min_p)
    apply_filters_triton(tri, idx, top_k, top_p, min_p)
    assert torch.equal(ref.view(torch.int32), tri.view(torch.int32))
    kept = _kept(ref)
    assert torch.equal(torch.where(ref == NEG_INF, logits, ref), logits)  # kept entries untouched
    for b, (row, r) in enumerate(zip(logits.cpu().tolist(), idx.cpu().tolist())):
        expected, clear = _py_kept(row, int(top_k[r]), float(top_p[r]), float(min_p[r]))
        assert clear, f"row {b}: test data too close to a threshold for a float32 comparison"
        assert kept[b] == expected, (b, r)
    return kept


# ------------------------------------------------------------------------------------------------ agreement


@pytest.mark.parametrize("vocab", [1, 999, 1024, 4097])
@pytest.mark.parametrize("num_reqs", [0, 1, 6])
def test_ref_triton_oracle_agree(num_reqs: int, vocab: int) -> None:
    """Random rows mapped out of order (with repeats) onto the SETTINGS table."""
    g = torch.Generator().manual_seed(1000 * num_reqs + vocab)
    idx = torch.randint(0, len(SETTINGS), (num_reqs,), generator=g, dtype=torch.int32).to(DEVICE)
    _check_all_paths(_logits(num_reqs, vocab, seed=vocab + num_reqs), idx, *_tables(vocab))


@pytest.mark.parametrize("vocab", [999, 4097])
def test_every_setting(vocab: int) -> None:
    """One batch row per SETTINGS row, shuffled (chosen so that no row sits within MARGIN of a threshold); the effect
    of each setting is as intended."""
    n = len(SETTINGS)
    idx = torch.tensor([(7 * b + 4) % n for b in range(n)], dtype=torch.int32, device=DEVICE)
    logits = _logits(n, vocab, seed=7 * vocab)
    kept = _check_all_paths(logits, idx, *_tables(vocab))
    size = {SETTINGS[r]: len(s) for r, s in zip(idx.tolist(), kept)}
    finite = {SETTINGS[r]: len(s) for r, s in zip(idx.tolist(), _kept(logits))}
    for setting in [(0, 1.0, 0.0), ("V", 1.0, 0.0), ("V+9", 1.0, 0.0)]:
        assert size[setting] == finite[setting]
    assert size[("V-1", 1.0, 0.0)] == min(finite[("V-1", 1.0, 0.0)], vocab - 1)  # distinct values at the boundary
    for setting in [(1, 1.0, 0.0), (0, 1e-7, 0.0), (0, 1.0, 1.0)]:
        assert 1 <= size[setting] < 10  # the argmax and its ties (even rows are quantised: ties are common)
    assert size[(0, 1.0, 0.05)] < finite[(0, 1.0, 0.05)] and size[(0, 0.5, 0.0)] < finite[(0, 0.5, 0.0)]


def test_ties_at_thresholds() -> None:
    """Hand-made rows over V = 4097 (ties across vocab blocks); expected sets written out."""
    vocab = 4097
    x = torch.full((7, vocab), -10.0)
    x[:, :50] = torch.linspace(-9.0, -8.0, 50)
    x[0, [7, 2000, 4096]] = 5.0  # k = 3: the 3rd largest is 5.0, tied three ways, plus the 6.0
    x[0, 100] = 6.0
    x[1] = x[0]  # k = 1: the 6.0 only
    x[2, [0, 4096, 1234]] = 3.0  # min_p = 1: the tied maxima
    x[3] = NEG_INF
    x[3, [5, 4000]] = 3.0  # top_p = 0.3: the first group (84% of the mass) is two tied tokens
    x[3, 6] = 2.0
    x[4, 10], x[4, 20], x[4, 4095] = 1.0, 0.0, -0.0  # k = 2: +0.0 and -0.0 tie
    x[5] = NEG_INF  # every logit -inf, every filter on: stays -inf
    x[6, [1, 2, 3, 3000]] = 2.0  # top_p = 0.1 reached inside a four-way tie: all four kept
    top_k = torch.tensor([3, 1, 0, 0, 2, 1, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.3, 1.0, 0.5, 0.1])
    min_p = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    idx = torch.tensor([6, 5, 4, 3, 2, 1, 0], dtype=torch.int32)  # row b uses table row 6 - b
    args = [t.to(DEVICE) for t in (x.flip(0), idx, top_k, top_p, min_p)]
    kept = _check_all_paths(*args)
    expected = [{1, 2, 3, 3000}, set(), {10, 20, 4095}, {5, 4000}, {0, 1234, 4096}, {100}, {7, 100, 2000, 4096}]
    assert kept == expected


def test_order_min_p_then_top_k_then_top_p() -> None:
    """top_p renormalises over what min_p / top_k kept; applied first it would keep more."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    idx = torch.tensor([0, 1], dtype=torch.int32)
    top_k = torch.tensor([2, 0], dtype=torch.int32)
    top_p = torch.tensor([0.5, 0.75])  # row 0: 0.4 / 0.7 >= 0.5; full-vocab top_p 0.5 would keep {0, 1}
    min_p = torch.tensor([0.0, 0.3])  # row 1: keeps {0, 1, 2}; then 0.4 / 0.9 + 0.3 / 0.9 >= 0.75 (full: {0, 1, 2})
    args = [t.to(DEVICE) for t in (probs.log(), idx, top_k, top_p, min_p)]
    assert _check_all_paths(*args) == [{0}, {0, 1}]


def test_all_off_rows_bit_identical() -> None:
    """Off settings (k <= 0 or >= V, p >= 1, min_p <= 0) never touch a row, whatever it holds (-0.0, NaN, +-inf)."""
    vocab = 1030
    x = torch.randn(6, vocab) * 5
    x[:, 3] = -0.0
    x[:, 4] = NEG_INF
    x[:, 5] = 1e30
    x[2, 6] = float("nan")
    x[4] = NEG_INF
    top_k = torch.tensor([0, vocab, vocab + 1, -1, 0, 5], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.5, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, -0.5, 0.0, 0.0])
    idx = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)
    for use_triton in (False, True):
        out = x.clone().to(DEVICE)
        apply_filters(out, *(t.to(DEVICE) for t in (idx, top_k, top_p, min_p)), use_triton=use_triton)
        assert torch.equal(out[:5].cpu().view(torch.int32), x[:5].view(torch.int32))
        kept = _kept(out[5:])[0]  # the only row with a filter on (k = 5): 1e30 and four runners-up
        assert len(kept) == 5 and 5 in kept


def test_noncontiguous_and_dispatcher() -> None:
    vocab = 1500
    logits = _logits(4, vocab, seed=3)
    idx = torch.tensor([15, 10, 11, 13], dtype=torch.int32, device=DEVICE)
    tables = _tables(vocab)
    expected = logits.clone()
    apply_filters_ref(expected, idx, *tables)
    for use_triton in (False, True):
        wide = torch.full((4, vocab + 70), 123.0, device=DEVICE)
        wide[:, 5 : vocab + 5] = logits
        apply_filters(wide[:, 5 : vocab + 5], idx, *tables, use_triton=use_triton)
        assert torch.equal(wide[:, 5 : vocab + 5], expected)
        assert bool((wide[:, :5] == 123.0).all()) and bool((wide[:, vocab + 5 :] == 123.0).all())


def test_key_constant() -> None:
    """The kernel's key of -inf: the bits of -inf with the 31 low bits flipped, as int32."""
    bits = int(torch.tensor([NEG_INF]).view(torch.int32))
    assert _KEY_NEG_INF.value == bits ^ 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------ statistics


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, 0.0), (8, 1.0, 0.0), (12, 0.8, 0.02), (0, 1.0, 0.05)])
def test_chi_square_filtered_sampling(top_k: int, top_p: float, min_p: float) -> None:
    """Filter a heavy-tailed (Zipf, p ~ rank^-1.2) 20-token distribution, sample 2000 seeds x 10 positions with the
    Gumbel sampler: no sample leaves the kept set, and the frequencies match the softmax renormalised over it
    (chi-square; p-value threshold P_THRESHOLD = 1e-3)."""
    vocab, n_seeds, n_pos = 20, 2000, 10
    n = n_seeds * n_pos
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))
    base = (-1.2 * torch.arange(1, vocab + 1, dtype=torch.float64).log())[torch.randperm(vocab, generator=g)]
    logits = base.float().repeat(n, 1).to(DEVICE)  # [n, V] float32
    idx = torch.zeros(n, dtype=torch.int32, device=DEVICE)  # every batch row reads table row 0
    tables = [torch.tensor([v], dtype=dt, device=DEVICE)
              for v, dt in ((top_k, torch.int32), (top_p, torch.float32), (min_p, torch.float32))]
    n_tri = n if DEVICE == "cuda" else 8  # the interpreter is slow: on CPU check agreement on a prefix only
    tri = logits[:n_tri].clone()
    apply_filters_triton(tri, idx[:n_tri], *tables)
    apply_filters_ref(logits, idx, *tables)
    assert torch.equal(tri, logits[:n_tri])
    kept, clear = _py_kept(base.float().tolist(), top_k, top_p, min_p)
    assert clear and 2 <= len(kept) < vocab and _kept(logits[:1]) == [kept]

    seeds = (torch.arange(n_seeds, dtype=torch.int64) * 1_000_003 + 29).repeat_interleave(n_pos).to(DEVICE)
    num_tokens = torch.arange(n_pos, dtype=torch.int32).repeat(n_seeds).to(DEVICE)
    tokens = sample_ref(logits, torch.arange(n, dtype=torch.int32, device=DEVICE),
                        torch.ones(n, device=DEVICE), seeds, num_tokens)
    counts = torch.bincount(tokens.long().cpu(), minlength=vocab).double()
    support = torch.zeros(vocab, dtype=torch.bool)
    support[sorted(kept)] = True
    assert counts[~support].sum() == 0  # never a token outside the kept set
    probs = torch.softmax(base.masked_fill(~support, NEG_INF), dim=0)
    chi2 = float((((counts - n * probs) ** 2)[support] / (n * probs[support])).sum())
    p_value = float(stats.chi2.sf(chi2, df=len(kept) - 1))
    assert p_value > P_THRESHOLD, (chi2, p_value, counts.tolist())


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "pos, bad, match",
    [
        (0, torch.zeros(2, 5, dtype=torch.float64), "logits must be torch.float32"),
        (0, torch.zeros(10), "logits must be 2-D"),
        (0, torch.zeros(2, 0), "vocab dimension"),
        (1, torch.zeros(3, dtype=torch.int32), "idx_mapping has 3 entries, logits has 2 rows"),
        (1, torch.zeros(2, dtype=torch.int64), "idx_mapping must be torch.int32"),
        (2, torch.zeros(4), "top_k must be torch.int32"),
        (3, torch.ones(4, dtype=torch.float64), "top_p must be torch.float32"),
        (4, torch.zeros(4, 1), "min_p must be 1-D"),
        (4, torch.zeros(5), "per-row tables differ"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_validation(pos: int, bad: torch.Tensor, match: str, use_triton: bool) -> None:
    args = [torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.ones(4),
            torch.zeros(4)]
    args[pos] = bad
    with pytest.raises(ValueError, match=match):
        apply_filters(*(a.to(DEVICE) for a in args), use_triton=use_triton)
