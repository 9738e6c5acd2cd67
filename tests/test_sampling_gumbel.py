"""Tests for graphrunner.sampling.gumbel: hash agreement (Python ints / PyTorch / Triton), greedy, batch invariance,
masked logits and a chi-square goodness-of-fit of the sampled frequencies against softmax(logits / T).

Runs on CUDA when available, else on CPU with Triton in interpreter mode (slow: the Triton batches stay small there).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from graphrunner.sampling import gumbel_noise_ref, gumbel_noise_triton, sample, sample_ref, sample_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P_THRESHOLD = 1e-3  # goodness-of-fit tests fail below this p-value; inputs are fixed, so the outcome is deterministic
EDGE_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0xDEADBEEF, 2**32, 2**32 + 1, 123456789012345]


def _py_mix32(x: int) -> int:
    """lowbias32 in plain Python integers: the independent oracle for the hash."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _py_gumbel(seed: int, pos: int, v: int) -> float:
    m = 0xFFFFFFFF
    k = _py_mix32((seed & m) ^ 0x9E3779B9)
    k = _py_mix32(k ^ ((seed >> 32) & m))
    k = _py_mix32(k ^ (pos & m))
    k1 = _py_mix32(k ^ ((pos >> 32) & m))
    k2 = _py_mix32(k1 ^ 0x85EBCA6B)
    h = _py_mix32(_py_mix32(v ^ k1) ^ k2)
    u = ((h >> 9) + 0.5) * 2.0**-23
    assert 0.0 < u < 1.0
    return -math.log(-math.log(u))


def _i64(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64, device=DEVICE)


def _batch(num_reqs: int, vocab: int, seed: int, dtype: torch.dtype = torch.float32, temps: list[float] | None = None):
    """Random logits plus per-row tables of R = num_reqs + 3 rows, addressed through a shuffled idx_mapping."""
    g = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + 3
    logits = (torch.randn(num_reqs, vocab, generator=g) * 3).to(dtype)
    idx = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    choices = torch.tensor(temps if temps is not None else [0.0, 0.3, 1.0, 1.7])
    temperature = choices[torch.randint(0, len(choices), (num_rows,), generator=g)].float()
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=g, dtype=torch.int64)
    num_tokens = torch.randint(0, 5000, (num_rows,), generator=g, dtype=torch.int32)
    return [t.to(DEVICE) for t in (logits, idx, temperature, seeds, num_tokens)]


# ------------------------------------------------------------------------------------------------ the noise


def test_noise_matches_python_oracle() -> None:
    positions = [0, 7, 2**31 + 5, 2**40 + 3, 12, 1, 0, 99, 4]
    ref = gumbel_noise_ref(_i64(EDGE_SEEDS), _i64(positions), 50).cpu()
    for b, (s, p) in enumerate(zip(EDGE_SEEDS, positions)):
        expected = torch.tensor([_py_gumbel(s, p, v) for v in range(50)], dtype=torch.float64)
        torch.testing.assert_close(ref[b].double(), expected, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("vocab", [1, 999, 1024, 4097])
def test_noise_ref_vs_triton(vocab: int) -> None:
    seeds = _i64(EDGE_SEEDS[:5])
    positions = _i64([0, 3, 2**31 + 1, 2**40, 77])
    torch.testing.assert_close(gumbel_noise_triton(seeds, positions, vocab), gumbel_noise_ref(seeds, positions, vocab),
                               atol=1e-5, rtol=1e-6)


def test_noise_is_gumbel_and_decorrelated() -> None:
    """Kolmogorov-Smirnov against Gumbel(0, 1); neighbouring positions / seeds / vocab ids are uncorrelated."""
    n = 4000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 - 10**12
    pos = torch.arange(n, dtype=torch.int64) % 37
    g0 = gumbel_noise_ref(seeds, pos, 25)  # [n, 25]
    assert stats.kstest(g0.flatten().double().numpy(), "gumbel_r").pvalue > P_THRESHOLD
    g_pos = gumbel_noise_ref(seeds, pos + 1, 25)
    g_seed = gumbel_noise_ref(seeds + 1, pos, 25)
    g_hi = gumbel_noise_ref(seeds + 2**32, pos, 25)  # differs only in the seed's high 32 bits
    bound = 5 / math.sqrt(g0.numel())
    for other in (g_pos, g_seed, g_hi, g0.roll(1, dims=1)):
        r = torch.corrcoef(torch.stack([g0.flatten(), other.flatten()]))[0, 1]
        assert abs(float(r)) < bound
    assert not torch.equal(g0, g_hi)


# ------------------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("vocab", [1, 999, 1024, 4097])
def test_sample_ref_vs_triton(vocab: int) -> None:
    args = _batch(7, vocab, seed=vocab)
    a = sample_ref(*args)
    b = sample_triton(*args)
    assert a.dtype == b.dtype == torch.int32 and a.shape == (7,)
    assert torch.equal(a, b)
    if vocab == 1:
        assert a.tolist() == [0] * 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_upcast(dtype: torch.dtype) -> None:
    logits, *rest = _batch(6, 999, seed=3, dtype=dtype)
    for use_triton in (False, True):
        assert torch.equal(sample(logits, *rest, use_triton=use_triton), sample_ref(logits.float(), *rest))


def test_noncontiguous_logits() -> None:
    logits, *rest = _batch(5, 1030, seed=4)
    wide = torch.full((5, 1100), 1e4, device=DEVICE)
    wide[:, :1030] = logits
    expected = sample_ref(logits, *rest)
    assert torch.equal(sample_triton(wide[:, :1030], *rest), expected)
    assert torch.equal(sample_ref(wide[:, :1030], *rest), expected)


def test_sample_matches_loop_oracle() -> None:
    """Python loop: argmax_v(logits[b, v] / T + python-int Gumbel noise)."""
    logits, idx, temperature, seeds, num_tokens = _batch(6, 37, seed=11, temps=[0.0, 0.5, 1.0, 2.0])
    lg, rows = logits.cpu().double().tolist(), idx.cpu().tolist()
    expected = []
    for b, row in enumerate(rows):
        t, s, p = float(temperature[row]), int(seeds[row]), int(num_tokens[row])
        vals = lg[b] if t == 0 else [x / t + _py_gumbel(s, p, v) for v, x in enumerate(lg[b])]
        expected.append(max(range(37), key=lambda v, vals=vals: (vals[v], -v)))
    for use_triton in (False, True):
        assert sample(logits, idx, temperature, seeds, num_tokens, use_triton=use_triton).tolist() == expected


def test_greedy_is_exact_argmax_lowest_index_on_ties() -> None:
    logits, idx, _, seeds, num_tokens = _batch(4, 4097, seed=5)
    temperature = torch.zeros_like(seeds, dtype=torch.float32)
    logits[0, [4096, 5, 1030]] = 50.0  # ties across blocks: lowest index wins
    logits[1, [700, 3]] = 50.0  # ties inside one block
    logits[2, 4096] = 50.0  # the lone last element of the last block
    logits[3, :] = -1.0  # all equal
    expected = [5, 3, 4096, 0]
    assert logits.argmax(dim=-1).tolist() == expected
    for use_triton in (False, True):
        assert sample(logits, idx, temperature, seeds, num_tokens, use_triton=use_triton).tolist() == expected


def test_same_seed_same_token_whatever_the_batch() -> None:
    num = 32
    logits, _, temperature, seeds, num_tokens = _batch(num, 999, seed=6, temps=[0.0, 0.7, 1.0, 1.3])
    idx = torch.randperm(num + 3)[:num].to(torch.int32).to(DEVICE)
    perm = torch.randperm(num).to(DEVICE)
    for use_triton in (False, True):
        full = sample(logits, idx, temperature, seeds, num_tokens, use_triton=use_triton)
        shuffled = sample(logits[perm], idx[perm], temperature, seeds, num_tokens, use_triton=use_triton)
        assert torch.equal(shuffled, full[perm])
        for b in range(0, num, 3 if use_triton else 1):
            alone = sample(logits[b : b + 1], idx[b : b + 1], temperature, seeds, num_tokens, use_triton=use_triton)
            assert int(alone) == int(full[b])


def test_different_positions_give_different_tokens() -> None:
    """Flat logits: the token is a pure function of the noise, so it varies with the position and the seed."""
    logits = torch.zeros(1, 1000, device=DEVICE)
    idx = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    temp = torch.ones(1, device=DEVICE)
    tokens = {int(sample_ref(logits, idx, temp, _i64([42]), torch.tensor([p], dtype=torch.int32, device=DEVICE)))
              for p in range(20)}
    assert len(tokens) >= 15
    for p in (0, 9):
        pos = torch.tensor([p], dtype=torch.int32, device=DEVICE)
        noise = gumbel_noise_ref(_i64([42]), _i64([p]), 1000)
        assert int(sample_triton(logits, idx, temp, _i64([42]), pos)) == int(noise.argmax())


def test_masked_logits_never_sampled() -> None:
    vocab, num = 999, 200
    allowed = torch.tensor([0, 17, 500, 511, 512, 998])
    logits = torch.full((num, vocab), float("-inf"))
    logits[:, allowed] = torch.randn(num, len(allowed)) * 4
    logits[-1, :] = float("-inf")
    logits[-1, 998] = -1e30  # one finite entry at the very end, far below the rest
    idx = torch.arange(num, dtype=torch.int32)
    temperature = torch.tensor([1.0, 5.0, 100.0, 0.0]).repeat(num // 4)
    temperature[-1] = 1.0
    seeds = torch.arange(num, dtype=torch.int64) * 31
    num_tokens = torch.arange(num, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (logits, idx, temperature, seeds, num_tokens)]
    ref = sample_ref(*args).cpu()
    assert torch.isin(ref, allowed).all()
    assert int(ref[-1]) == 998
    n_tri = num if DEVICE == "cuda" else 24
    tri = sample_triton(args[0][-n_tri:], args[1][-n_tri:], *args[2:]).cpu()
    assert torch.equal(tri, ref[-n_tri:])


def test_empty_batch() -> None:
    logits = torch.zeros(0, 10, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    tables = (torch.ones(3, device=DEVICE), _i64([1, 2, 3]), torch.zeros(3, dtype=torch.int32, device=DEVICE))
    for use_triton in (False, True):
        out = sample(logits, empty, *tables, use_triton=use_triton)
        assert out.shape == (0,) and out.dtype == torch.int32


@pytest.mark.parametrize("temp", [0.8, 2.0])
def test_chi_square_matches_softmax(temp: float) -> None:
    """Frequencies over 2000 seeds x 10 positions match softmax(logits / T); p-value threshold P_THRESHOLD."""
    base = torch.tensor([1.5, 0.3, -0.2, 0.0, -1.0, float("-inf"), -2.5])
    n_seeds, n_pos = 2000, 10
    n = n_seeds * n_pos
    logits = base.repeat(n, 1).to(DEVICE)
    idx = torch.arange(n, dtype=torch.int32, device=DEVICE)
    temperature = torch.full((n,), temp, device=DEVICE)
    seeds = (torch.arange(n_seeds, dtype=torch.int64) * 1_000_003 + 17).repeat_interleave(n_pos).to(DEVICE)
    num_tokens = torch.arange(n_pos, dtype=torch.int32).repeat(n_seeds).to(DEVICE)
    args = (logits, idx, temperature, seeds, num_tokens)
    tokens = sample_ref(*args)
    n_tri = n if DEVICE == "cuda" else 64  # the interpreter is slow: on CPU check agreement on a prefix only
    tri = sample_triton(*(a[:n_tri] for a in args[:2]), *args[2:])
    assert torch.equal(tri, tokens[:n_tri])
    counts = torch.bincount(tokens.long().cpu(), minlength=len(base)).double()
    probs = torch.softmax(base.double() / temp, dim=0)
    assert counts[5] == 0  # the -inf entry
    keep = probs > 0
    chi2 = float((((counts - n * probs) ** 2)[keep] / (n * probs[keep])).sum())
    p_value = float(stats.chi2.sf(chi2, df=int(keep.sum()) - 1))
    assert p_value > P_THRESHOLD, (chi2, p_value, counts.tolist())


@pytest.mark.parametrize(
    "pos, bad, match",
    [
        (0, torch.zeros(2, 5, dtype=torch.float64), "logits must be"),
        (0, torch.zeros(2, 0), "vocab dimension"),
        (1, torch.zeros(3, dtype=torch.int32), "idx_mapping has 3 entries, logits has 2 rows"),
        (2, torch.zeros(4, dtype=torch.float16), "temperature must be torch.float32"),
        (3, torch.zeros(4, dtype=torch.int32), "seeds must be torch.int64"),
        (4, torch.zeros(5, dtype=torch.int32), "per-row tables differ"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_validation(pos: int, bad: torch.Tensor, match: str, use_triton: bool) -> None:
    args = [torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), torch.ones(4), torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int32)]
    args[pos] = bad
    with pytest.raises(ValueError, match=match):
        sample(*(a.to(DEVICE) for a in args), use_triton=use_triton)
