"""propose_ngram (prompt-lookup drafts): Triton kernel (interpreter on CPU) vs PyTorch reference vs a plain-Python
oracle, on awkward history lengths, batch sizes, n ranges and k; plus hand-made cases and a CUDA-graph capture."""

from __future__ import annotations

import random

import pytest
import torch

from graphrunner.spec_decode.ngram import propose_ngram, propose_ngram_ref, propose_ngram_triton

# the Triton kernel's device: CUDA where there is one (Triton's CPU interpreter is then off), else CPU tensors
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

_NS = [(1, 1), (1, 3), (2, 4)]
_KS = [1, 3, 5]
_VOCAB = 5  # small: matches are frequent


def _lengths(max_n: int) -> list[int]:
    return [1, 2, max_n, max_n + 1, 37, 130, 257]


def _oracle(hist: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The drafts of one history, with lists: longest n first, earliest occurrence (not the suffix itself)."""
    size = len(hist)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        pattern = hist[size - n:]
        for s in range(size - n):
            if hist[s:s + n] == pattern:
                return hist[s + n:s + n + k]
    return []


def _table(hists: dict[int, list[int]], num_rows: int, max_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids [R, L] / num_tokens [R]: rows in `hists` hold them; everything else (other rows, the tail past
    num_tokens) is random garbage from the same vocabulary, so reading it would change the answer."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, _VOCAB, (num_rows, max_len), generator=g, dtype=torch.int32)
    num_tokens = torch.randint(0, max_len + 1, (num_rows,), generator=g, dtype=torch.int32)
    for row, h in hists.items():
        token_ids[row, :len(h)] = torch.tensor(h, dtype=torch.int32)
        num_tokens[row] = len(h)
    return token_ids, num_tokens


def _expected(hists: list[list[int]], min_n: int, max_n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    drafts = torch.full((len(hists), k), -1, dtype=torch.int32)
    num = torch.zeros(len(hists), dtype=torch.int32)
    for b, h in enumerate(hists):
        d = _oracle(h, min_n, max_n, k)
        drafts[b, :len(d)] = torch.tensor(d, dtype=torch.int32)
        num[b] = len(d)
    return drafts, num


def _check_all(idx_mapping: torch.Tensor, token_ids: torch.Tensor, num_tokens: torch.Tensor, hists: list[list[int]],
               min_n: int, max_n: int, k: int, blocks: tuple[int, ...] = (16, 256)) -> None:
    want_d, want_n = _expected(hists, min_n, max_n, k)
    got = [propose_ngram_ref(idx_mapping, token_ids, num_tokens, min_n, max_n, k)]
    on_kernel = [t.to(KERNEL_DEVICE) for t in (idx_mapping, token_ids, num_tokens)]
    got += [tuple(t.cpu() for t in propose_ngram_triton(*on_kernel, min_n, max_n, k, block=b)) for b in blocks]
    for drafts, num in got:
        assert drafts.dtype == torch.int32 and num.dtype == torch.int32
        assert torch.equal(num, want_n), (num, want_n)
        assert torch.equal(drafts, want_d), (drafts, want_d)


def _random_hist(rng: random.Random, length: int, vocab: int = _VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("min_n,max_n", _NS)
@pytest.mark.parametrize("k", _KS)
@pytest.mark.parametrize("batch", [0, 1, 3, 7])
def test_random_batches_match_oracle(min_n: int, max_n: int, k: int, batch: int) -> None:
    """idx_mapping is a seeded subset of the rows in shuffled order; B = 7 covers every awkward length."""
    rng = random.Random(1000 * batch + 10 * k + max_n)
    lengths = _lengths(max_n)
    lens = lengths if batch == 7 else rng.sample(lengths, batch)
    num_rows, max_len = batch + 5, 300
    rows = rng.sample(range(num_rows), batch)
    hists = [_random_hist(rng, n, vocab=rng.choice([2, _VOCAB, 50])) for n in lens]
    token_ids, num_tokens = _table(dict(zip(rows, hists)), num_rows, max_len, seed=batch + k)
    idx_mapping = torch.tensor(rows, dtype=torch.int32)
    _check_all(idx_mapping, token_ids, num_tokens, hists, min_n, max_n, k)


@pytest.mark.parametrize("min_n,max_n", _NS)
@pytest.mark.parametrize("k", _KS)
def test_each_length_alone(min_n: int, max_n: int, k: int) -> None:
    """B = 1 for every awkward length, with a history filling its row exactly (no tail) and one with a tail."""
    rng = random.Random(7 * k + max_n)
    for length in _lengths(max_n):
        for max_len in (length, length + 3):
            h = _random_hist(rng, length)
            token_ids, num_tokens = _table({0: h}, 2, max_len, seed=length)
            _check_all(torch.tensor([0], dtype=torch.int32), token_ids, num_tokens, [h], min_n, max_n, k)


@pytest.mark.parametrize("hist,min_n,max_n,k,want", [
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 3, [9, 1, 2]),  # two earlier matches: the earliest wins
    ([1, 2, 9, 1, 2, 8, 1, 2], 1, 1, 2, [9, 1]),  # n = 1: pattern [2], earliest at 1
    ([4, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3, 2, [8, 1]),  # the longer n-gram wins over an earlier shorter one
    ([4, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 2, 2, [9, 1]),  # with n = 2 only, the earlier [2, 3] wins
    ([5, 5, 5], 1, 2, 5, [5]),  # n = 2 at s = 0 overlaps the suffix; 1 following token < k
    ([5, 5, 5], 1, 1, 5, [5, 5]),  # n = 1 at s = 0: two following tokens < k
    ([7, 7], 1, 1, 3, [7]),
    ([7, 7], 2, 2, 3, []),  # history no longer than n: nothing to look up
    ([7], 1, 1, 3, []),
    ([], 1, 3, 3, []),
    ([1, 2, 3, 4, 5, 6], 1, 3, 4, []),  # no repeat, no match
    ([3, 1, 2, 3], 1, 2, 4, [1, 2, 3]),  # the match's drafts run up to the end of the history
])
def test_hand_made(hist: list[int], min_n: int, max_n: int, k: int, want: list[int]) -> None:
    assert _oracle(hist, min_n, max_n, k) == want
    token_ids, num_tokens = _table({1: hist}, 3, 12, seed=3)
    _check_all(torch.tensor([1], dtype=torch.int32), token_ids, num_tokens, [hist], min_n, max_n, k, blocks=(1, 2, 256))


def test_padding_rows_and_repeats() -> None:
    """Captured batches pad with a row of 1 token that many slots share; scheduled rows may come in any order."""
    rng = random.Random(5)
    hists = {0: _random_hist(rng, 40), 2: [9], 3: _random_hist(rng, 130)}
    token_ids, num_tokens = _table(hists, 4, 140, seed=11)
    order = [3, 2, 0, 2, 2]
    _check_all(torch.tensor(order, dtype=torch.int32), token_ids, num_tokens, [hists[r] for r in order], 1, 3, 3)


def test_long_history_late_and_no_match() -> None:
    """4500-token histories: the only match is in the last block, or there is none (a full scan)."""
    rng = random.Random(9)
    base = list(range(100, 4500))  # all distinct
    late = base + [7, 8, 9, 1] + [7, 8, 9]  # [7, 8, 9] first occurs at 4400
    none = base + [1, 2, 3]
    token_ids, num_tokens = _table({0: late, 1: none}, 2, 4600, seed=2)
    token_ids[:, len(late):] = torch.tensor(_random_hist(rng, 4600 - len(late)), dtype=torch.int32) + 7
    _check_all(torch.tensor([0, 1], dtype=torch.int32), token_ids, num_tokens, [late, none], 2, 4, 5, blocks=(256,))


def test_num_tokens_clamped_to_row() -> None:
    token_ids = torch.tensor([[1, 2, 1, 2]], dtype=torch.int32)
    for nt in (4, 9, -3):
        num_tokens = torch.tensor([nt], dtype=torch.int32)
        hist = [1, 2, 1, 2][:max(0, min(nt, 4))]
        _check_all(torch.tensor([0], dtype=torch.int32), token_ids, num_tokens, [hist], 1, 2, 3)


@pytest.mark.parametrize("use_triton", [False, True])
def test_dispatcher_out(use_triton: bool) -> None:
    hist = [1, 2, 3, 1, 2]
    dev = KERNEL_DEVICE if use_triton else torch.device("cpu")
    token_ids, num_tokens = (t.to(dev) for t in _table({0: hist}, 2, 8, seed=1))
    idx = torch.tensor([0, 0], dtype=torch.int32, device=dev)
    out = (torch.zeros(2, 3, dtype=torch.int32, device=dev), torch.zeros(2, dtype=torch.int32, device=dev))
    drafts, num = propose_ngram(idx, token_ids, num_tokens, 1, 2, 3, use_triton, out=out)
    assert drafts.data_ptr() == out[0].data_ptr() and num.data_ptr() == out[1].data_ptr()
    assert drafts.tolist() == [[3, 1, 2]] * 2 and num.tolist() == [3, 3]
    plain = propose_ngram(idx, token_ids, num_tokens, 1, 2, 3, use_triton)
    assert torch.equal(plain[0], drafts) and torch.equal(plain[1], num)


def test_argument_checks() -> None:
    idx = torch.zeros(1, dtype=torch.int32)
    tok = torch.zeros(2, 8, dtype=torch.int32)
    nt = torch.ones(2, dtype=torch.int32)
    bad = [
        ((idx.long(), tok, nt, 1, 2, 3), "idx_mapping"),
        ((idx, tok.long(), nt, 1, 2, 3), "token_ids"),
        ((idx, tok, nt[:1], 1, 2, 3), "row counts"),
        ((idx, tok.t(), torch.ones(8, dtype=torch.int32), 1, 2, 3), "unit stride"),
        ((idx, tok, nt, 0, 2, 3), "min_n"),
        ((idx, tok, nt, 3, 2, 3), "min_n"),
        ((idx, tok, nt, 1, 2, 0), "k"),
    ]
    for args, msg in bad:
        for fn in (propose_ngram_ref, propose_ngram_triton):
            with pytest.raises(ValueError, match=msg):
                fn(*args)
    with pytest.raises(ValueError, match="out must be"):
        propose_ngram(idx, tok, nt, 1, 2, 3, True, out=(torch.zeros(1, 2, dtype=torch.int32), nt[:1]))
    with pytest.raises(ValueError, match="power of two"):
        propose_ngram_triton(idx, tok, nt, 1, 2, 3, block=48)


@pytest.mark.gpu
def test_gpu_compiled_and_graph_capture() -> None:
    """The compiled kernel (not the interpreter) agrees with the oracle, and both paths capture in a CUDA graph
    (capture fails on any host synchronisation)."""
    rng = random.Random(0)
    lens = [1, 2, 4, 5, 37, 130, 257, 1000, 4096]
    hists = [_random_hist(rng, n) for n in lens]
    rows = list(range(len(lens)))[::-1]
    token_ids, num_tokens = _table(dict(zip(rows, hists)), len(lens) + 1, 4096, seed=0)
    dev = torch.device("cuda")
    idx, token_ids, num_tokens = torch.tensor(rows, dtype=torch.int32, device=dev), token_ids.cuda(), num_tokens.cuda()
    for min_n, max_n in _NS:
        for k in _KS:
            want_d, want_n = _expected(hists, min_n, max_n, k)
            for use_triton in (False, True):
                out = (torch.empty(len(lens), k, dtype=torch.int32, device=dev),
                       torch.empty(len(lens), dtype=torch.int32, device=dev))
                propose_ngram(idx, token_ids, num_tokens, min_n, max_n, k, use_triton, out=out)  # warm-up / compile
                out[0].zero_()
                out[1].zero_()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    propose_ngram(idx, token_ids, num_tokens, min_n, max_n, k, use_triton, out=out)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out[1].cpu(), want_n) and torch.equal(out[0].cpu(), want_d), (min_n, max_n, k)
