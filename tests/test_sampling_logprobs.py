"""Tests for graphrunner.sampling.logprobs: Triton vs reference vs independent oracles (torch.log_softmax, a
stable full sort, plain-Python rank counts) on awkward sizes, -inf and 1e4-magnitude logits, exact ties, and
chunked prompt logprobs. Runs on CUDA when available, else on CPU with Triton in interpreter mode.
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.sampling.logprobs import (
    LogprobsTensors,
    compute_logprobs,
    compute_logprobs_ref,
    compute_logprobs_triton,
    prompt_logprobs_chunked,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")
FIELDS = ("top_ids", "top_logprobs", "token_logprob", "token_rank")


def _case(num_rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits whose rows cycle through: plain, 1e4 magnitude, sprinkled -inf, all -inf but one, +1e4 offset."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, vocab, (num_rows,), generator=g)
    for n in range(num_rows):
        kind = n % 5
        if kind == 1:
            logits[n] *= 1e4 / 3  # large magnitudes: logprobs need the max-shifted form to keep 1e-5
        elif kind == 2:
            logits[n, torch.rand(vocab, generator=g) < 0.3] = NEG_INF
            tokens[n] = int(torch.argmin(logits[n]))  # a -inf token when there is one: logprob -inf
        elif kind == 3:
            logits[n] = NEG_INF
            logits[n, vocab // 2] = 7.0  # the lone finite entry: logprob 0, rank 1
            tokens[n] = vocab - 1 if n % 2 else vocab // 2
        elif kind == 4:
            logits[n] += 1e4
            tokens[n] = int(torch.argmax(logits[n]))  # rank 1
    return logits.float().to(DEVICE), tokens.to(torch.int32).to(DEVICE)


def _assert_match(a: LogprobsTensors, b: LogprobsTensors, atol: float = 1e-5) -> None:
    assert torch.equal(a.top_ids, b.top_ids)
    assert torch.equal(a.token_rank, b.token_rank)
    torch.testing.assert_close(a.top_logprobs, b.top_logprobs, atol=atol, rtol=0)
    torch.testing.assert_close(a.token_logprob, b.token_logprob, atol=atol, rtol=0)


def _check_layout(out: LogprobsTensors, num_rows: int, k: int) -> None:
    assert out.top_ids.shape == out.top_logprobs.shape == (num_rows, k)
    assert out.token_logprob.shape == out.token_rank.shape == (num_rows,)
    assert out.top_ids.dtype == out.token_rank.dtype == torch.int32
    assert out.top_logprobs.dtype == out.token_logprob.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ compute_logprobs


SIZES = [(n, v, k) for n in (0, 1, 7) for v in (1, 999, 1024, 4097) for k in (0, 1, 5, 20) if k <= v]


@pytest.mark.parametrize("num_rows, vocab, k", SIZES)
def test_triton_matches_ref_and_oracles(num_rows: int, vocab: int, k: int) -> None:
    logits, tokens = _case(num_rows, vocab, seed=num_rows * 10_000 + vocab + k)
    ref = compute_logprobs_ref(logits, tokens, k)
    tri = compute_logprobs_triton(logits, tokens, k)
    _check_layout(ref, num_rows, k)
    _check_layout(tri, num_rows, k)
    _assert_match(tri, ref)
    # Independent oracles (random data has no exact ties except among -inf entries).
    lsm = torch.log_softmax(logits.double(), dim=-1).float()  # [N, V]
    torch.testing.assert_close(ref.token_logprob, lsm.gather(-1, tokens.long()[:, None])[:, 0], atol=1e-5, rtol=0)
    vals, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # ascending id among equal logits
    assert torch.equal(logits.gather(-1, ref.top_ids.long()), vals[:, :k])
    # Places whose logit beats the (k+1)-th are fixed; equal logits at the k-th place (e.g. -inf) may be any of them.
    fixed = vals[:, :k] > vals[:, k : k + 1] if k < vocab else torch.ones_like(vals, dtype=torch.bool)
    assert torch.equal(torch.where(fixed, ref.top_ids, -1), torch.where(fixed, order[:, :k].to(torch.int32), -1))
    torch.testing.assert_close(ref.top_logprobs, lsm.gather(-1, order[:, :k]), atol=1e-5, rtol=0)
    assert torch.equal(ref.top_logprobs == NEG_INF, vals[:, :k] == NEG_INF)
    rows, toks = logits.cpu().tolist(), tokens.cpu().tolist()
    ranks = [1 + sum(x > row[t] for x in row) for row, t in zip(rows, toks)]
    assert ref.token_rank.tolist() == ranks
    for n, (row, t) in enumerate(zip(rows, toks)):
        if n % 5 == 3:  # all -inf except one entry
            assert float(ref.token_logprob[n]) == (0.0 if row[t] > NEG_INF else NEG_INF)
            assert ranks[n] == (1 if row[t] > NEG_INF else 2)


def test_exact_ties() -> None:
    """Equal logits share a rank (1 + strictly greater); inside the top k they are listed by ascending id.

    Where equal logits straddle the k-th place, which of them get in is torch.topk's choice: the logprobs are the
    same whichever it picks, and both paths pick alike (they share the selection).
    """
    vocab, k = 4097, 5
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).clamp(-3, 3).to(DEVICE)
    logits[0, [4000, 7, 1500]] = 9.0  # a tie across vocab blocks, entirely inside the top 5
    logits[0, 3000] = 10.0
    logits[1, [4096, 2, 2048, 9, 100, 3333, 17]] = 8.0  # 7 equal maxima for 5 places
    logits[2, :] = -1.5  # all equal
    logits[3, [11, 12]] = 5.0
    logits[3, [13]] = NEG_INF
    tokens = torch.tensor([1500, 17, 4096, 12], dtype=torch.int32, device=DEVICE)
    ref = compute_logprobs_ref(logits, tokens, k)
    tri = compute_logprobs_triton(logits, tokens, k)
    _assert_match(tri, ref)
    assert ref.top_ids[0].tolist()[:4] == [3000, 7, 1500, 4000]
    assert ref.top_ids[3].tolist()[:2] == [11, 12]
    row1 = ref.top_ids[1].tolist()
    assert len(set(row1)) == k and set(row1) <= {4096, 2, 2048, 9, 100, 3333, 17} and row1 == sorted(row1)
    assert sorted(ref.top_ids[2].tolist()) == ref.top_ids[2].tolist()
    assert ref.token_rank.tolist() == [2, 1, 1, 1]
    lsm = torch.log_softmax(logits.double(), dim=-1).float()
    torch.testing.assert_close(ref.top_logprobs[1], lsm[1, :k].new_full((k,), float(lsm[1, 4096])), atol=1e-6, rtol=0)
    torch.testing.assert_close(tri.top_logprobs[2], torch.full((k,), -torch.log(torch.tensor(float(vocab)))).to(DEVICE),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(tri.token_logprob, lsm.gather(-1, tokens.long()[:, None])[:, 0], atol=1e-5, rtol=0)


def test_all_neg_inf_row_is_defined() -> None:
    """No finite logit at all: every logprob is -inf (not NaN, unlike torch.log_softmax) and the rank is 1."""
    logits = torch.full((2, 999), NEG_INF, device=DEVICE)
    logits[1, 5] = 0.0
    tokens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    for use_triton in (False, True):
        out = compute_logprobs(logits, tokens, 3, use_triton=use_triton)
        assert out.token_logprob.tolist() == [NEG_INF, NEG_INF]
        assert out.token_rank.tolist() == [1, 2]
        assert out.top_logprobs.tolist() == [[NEG_INF] * 3, [0.0, NEG_INF, NEG_INF]]
        assert int(out.top_ids[1, 0]) == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_upcast(dtype: torch.dtype) -> None:
    """Half logits tie often: the two paths agree exactly on the half input, and the logprobs are those of the
    float32 upcast (the selection is the same multiset of logits whichever tied ids torch.topk keeps)."""
    logits, tokens = _case(6, 1030, seed=1)
    logits = logits.clamp(-60000, 60000).to(dtype)
    up = logits.float()
    lsm = torch.log_softmax(up.double(), dim=-1).float()
    ref = compute_logprobs_ref(logits, tokens, 5)
    _assert_match(compute_logprobs_triton(logits, tokens, 5), ref)
    assert torch.equal(up.gather(-1, ref.top_ids.long()), torch.topk(up, 5, dim=-1).values)
    torch.testing.assert_close(ref.top_logprobs, lsm.gather(-1, ref.top_ids.long()), atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.token_logprob, lsm.gather(-1, tokens.long()[:, None])[:, 0], atol=1e-5, rtol=0)
    assert torch.equal(ref.token_rank, compute_logprobs_ref(up, tokens, 0).token_rank)


def test_noncontiguous_logits() -> None:
    logits, tokens = _case(5, 1030, seed=2)
    wide = torch.full((5, 1100), 1e30, device=DEVICE)
    wide[:, :1030] = logits
    expected = compute_logprobs_ref(logits, tokens, 4)
    _assert_match(compute_logprobs_triton(wide[:, :1030], tokens, 4), expected)
    _assert_match(compute_logprobs_triton(logits.t().contiguous().t(), tokens, 4), expected)


@pytest.mark.parametrize(
    "logits, tokens, k, match",
    [
        (torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.int32), 1, "logits must be"),
        (torch.zeros(5), torch.zeros(5, dtype=torch.int32), 1, "logits must be 2-D"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.int32), 0, "vocab dimension"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64), 1, "token_ids must be torch.int32"),
        (torch.zeros(2, 5), torch.zeros(3, dtype=torch.int32), 1, "token_ids has 3 entries, logits has 2 rows"),
        (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), 6, "exceeds the vocab size 5"),
        (torch.zeros(2, 50), torch.zeros(2, dtype=torch.int32), 21, "num_top must be an int in"),
        (torch.zeros(2, 50), torch.zeros(2, dtype=torch.int32), -1, "num_top must be an int in"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_validation(logits: torch.Tensor, tokens: torch.Tensor, k: int, match: str, use_triton: bool) -> None:
    with pytest.raises(ValueError, match=match):
        compute_logprobs(logits.to(DEVICE), tokens.to(DEVICE), k, use_triton=use_triton)


@pytest.mark.gpu
def test_no_host_sync_on_cuda() -> None:
    logits, tokens = _case(7, 4097, seed=3)
    hidden = torch.randn(9, 8, device=DEVICE)
    weight = torch.randn(8, 4097, device=DEVICE)
    next_ids = torch.randint(0, 4097, (9,), dtype=torch.int32, device=DEVICE)
    compute_logprobs(logits, tokens, 20, use_triton=True)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        compute_logprobs(logits, tokens, 20, use_triton=True)
        prompt_logprobs_chunked(hidden, lambda h: h @ weight, next_ids, 5, chunk_size=4, use_triton=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------------------------ prompt logprobs


class _RecordingHead:
    """compute_logits = hidden @ W (in float64, rounded to float32: the same bits whatever the batch size)."""

    def __init__(self, hidden_size: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.weight = (torch.randn(hidden_size, vocab, generator=g, dtype=torch.float64) * 0.5).to(DEVICE)
        self.calls: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.clone())
        return (hidden.double() @ self.weight).float()


@pytest.mark.parametrize("use_triton", [False, True])
def test_prompt_logprobs_chunked_equals_unchunked(use_triton: bool) -> None:
    num_pos, hidden_size, vocab, k = 11, 16, 1030, 5
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(num_pos, hidden_size, generator=g).to(DEVICE)
    next_ids = torch.randint(0, vocab, (num_pos,), generator=g, dtype=torch.int32).to(DEVICE)
    head = _RecordingHead(hidden_size, vocab)
    full = compute_logprobs(head(hidden), next_ids, k, use_triton=use_triton)
    for chunk_size in (1, 3, num_pos, num_pos + 5):
        head.calls.clear()
        out = prompt_logprobs_chunked(hidden, head, next_ids, k, chunk_size=chunk_size, use_triton=use_triton)
        _check_layout(out, num_pos, k)
        _assert_match(out, full, atol=1e-6)
        assert max(c.shape[0] for c in head.calls) <= chunk_size
        assert len(head.calls) == -(-num_pos // chunk_size)
        assert torch.equal(torch.cat(head.calls), hidden)  # every position exactly once, in order


def test_prompt_logprobs_chunked_edges() -> None:
    head = _RecordingHead(4, 50)
    empty = prompt_logprobs_chunked(torch.zeros(0, 4, device=DEVICE), head, torch.zeros(0, dtype=torch.int32,
                                    device=DEVICE), 3, chunk_size=2, use_triton=True)
    _check_layout(empty, 0, 3)
    assert head.calls == []
    hidden = torch.randn(4, 4, device=DEVICE)
    ids = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=DEVICE)
    out = prompt_logprobs_chunked(hidden, head, ids, 0, chunk_size=3, use_triton=False)
    _check_layout(out, 4, 0)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        prompt_logprobs_chunked(hidden, head, ids, 2, chunk_size=0, use_triton=False)
    with pytest.raises(ValueError, match="next_token_ids has 3 entries, hidden has 4 rows"):
        prompt_logprobs_chunked(hidden, head, ids[:3], 2, chunk_size=2, use_triton=False)
    with pytest.raises(ValueError, match="compute_logits returned shape"):
        prompt_logprobs_chunked(hidden, lambda h: torch.zeros(1, 50, device=DEVICE), ids, 2, chunk_size=2,
                                use_triton=False)


def test_exports_and_fields() -> None:
    out = compute_logprobs(torch.zeros(1, 3, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE), 2,
                           use_triton=False)
    assert tuple(out.__dataclass_fields__) == FIELDS
