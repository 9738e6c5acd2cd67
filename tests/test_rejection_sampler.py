"""Tests for graphrunner.sampling.rejection and rejection_split: both Triton kernels (one program per request; the
vocabulary split across programs) vs the reference, bit-equal on awkward shapes, greedy acceptance vs a
plain-Python oracle, equality with graphrunner.sampling.gumbel for rows without drafts, and chi-square tests that the
emitted tokens follow the target distribution with one-hot (n-gram) and draft-model q, at the theoretical accept rate.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (the Triton batches stay small there).
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from graphrunner.sampling.gumbel_split import sample
from graphrunner.sampling.rejection import _accept_uniform_ref, rejection_sample_ref, rejection_sample_triton
from graphrunner.sampling.rejection_split import rejection_sample, rejection_sample_split_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P_THRESHOLD = 1e-3  # goodness-of-fit tests fail below this p-value; inputs are fixed, so the outcome is deterministic
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # log(0) in the interpreter


def _cu(num_drafts: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(num_drafts.shape[0] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(num_drafts + 1, dim=0)
    return cu


def _batch(num_reqs: int, k: int, vocab: int, with_q: bool, seed: int) -> dict:
    """A verify batch with k_b in [0, K] (first 0, last K), mixed greedy / sampled requests, some -inf logits and
    drafts that are the target argmax (so they are often accepted), random tokens or out of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    num_drafts = torch.randint(0, k + 1, (num_reqs,), generator=g, dtype=torch.int32)
    if num_reqs:
        num_drafts[0], num_drafts[-1] = 0, k
    cu = _cu(num_drafts)
    n = int(cu[-1])
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, 1::5] = float("-inf")  # column 0 stays finite, so every row has a finite entry
    draft_ids = torch.randint(0, vocab, (num_reqs, k), generator=g, dtype=torch.int32)
    for b in range(num_reqs):
        for j in range(int(num_drafts[b])):
            if (b + j) % 3 != 2:
                draft_ids[b, j] = logits[int(cu[b]) + j].argmax()
    if num_reqs == 5 and k == 3:  # out-of-vocabulary drafts are never accepted
        draft_ids[1, 0], draft_ids[4, 1] = -2, vocab + 3
    n_drafts = int(num_drafts.sum())
    q = torch.softmax(torch.randn(n_drafts, vocab, generator=g) * 2, dim=-1) if with_q else None
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.6])
    temperature = temps[torch.arange(num_reqs) % len(temps)].float()
    seeds = torch.randint(-(2**62), 2**62, (num_reqs,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**40, (num_reqs,), generator=g, dtype=torch.int64)
    args = {"logits": logits, "cu_num_logits": cu, "draft_ids": draft_ids, "num_drafts": num_drafts, "draft_probs": q,
            "temperature": temperature, "seeds": seeds, "positions": positions}
    return {key: (v.to(DEVICE) if v is not None else None) for key, v in args.items()}


def _check_structure(out: torch.Tensor, num_acc: torch.Tensor, args: dict) -> None:
    vocab = args["logits"].shape[1]
    out, num_acc = out.cpu(), num_acc.cpu()
    for b in range(out.shape[0]):
        na = int(num_acc[b])
        assert 0 <= na <= int(args["num_drafts"][b])
        assert torch.equal(out[b, :na], args["draft_ids"][b, :na].cpu())
        assert 0 <= int(out[b, na]) < vocab
        assert (out[b, na + 1:] == -1).all()


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 5003])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("num_reqs", [0, 1, 5])
def test_triton_matches_reference(num_reqs: int, k: int, vocab: int, with_q: bool) -> None:
    args = _batch(num_reqs, k, vocab, with_q, seed=1000 * num_reqs + 10 * k + vocab + with_q)
    out_ref, acc_ref = rejection_sample_ref(**args)
    out_tri, acc_tri = rejection_sample_triton(**args)
    assert out_ref.shape == (num_reqs, k + 1) and out_ref.dtype == torch.int32
    assert acc_ref.shape == (num_reqs,) and acc_ref.dtype == torch.int32
    assert torch.equal(out_ref, out_tri)
    assert torch.equal(acc_ref, acc_tri)
    _check_structure(out_ref, acc_ref, args)


@pytest.mark.parametrize("vocab", [1, 7, 1000, 3073, 5003])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("num_reqs", [0, 1, 5])
def test_split_kernel_matches_reference(num_reqs: int, k: int, vocab: int) -> None:
    """The split-vocab kernel (one-hot q) against the reference; on CPU each row of a one-request batch spans up to
    4 chunks of 1024 (3073: the last chunk holds one entry), so the chunk reductions are exercised."""
    args = _batch(num_reqs, k, vocab, False, seed=1000 * num_reqs + 10 * k + vocab + 5)
    del args["draft_probs"]
    out_ref, acc_ref = rejection_sample_ref(**args, draft_probs=None)
    out_split, acc_split = rejection_sample_split_triton(**args)
    assert torch.equal(out_ref, out_split)
    assert torch.equal(acc_ref, acc_split)


def test_acceptance_uses_the_whole_rows_softmax() -> None:
    """Sampled drafts are accepted iff u < p(d) (one-hot q), with p(d) over the whole row: the draft sits in the first
    1024-entry block and the row's max (just above it) in the last, so a softmax sum not rescaled as the running max
    grows would shrink p(d) and flip decisions."""
    num_reqs, vocab = 48, 5003
    g = torch.Generator().manual_seed(77)
    logits = torch.randn(2 * num_reqs, vocab, generator=g)  # each request: its draft row, then its bonus row
    want_p = torch.rand(num_reqs, generator=g, dtype=torch.float64) * 0.3 + 0.05  # [B] p(d) to aim at, < 1/(1+e^.5)
    others = torch.exp(logits[0::2].double()).sum(dim=-1) - torch.exp(logits[0::2, [3, vocab - 1]].double()).sum(-1)
    a = torch.log(want_p * others / (1 - want_p * (1 + math.exp(0.5))))  # [B] float64: d's logit for that p(d)
    logits[0::2, 3], logits[0::2, vocab - 1] = a.float(), (a + 0.5).float()
    p_d = torch.softmax(logits[0::2].double(), dim=-1)[:, 3]  # [B] float64, ~want_p
    args = {"logits": logits, "cu_num_logits": _cu(torch.ones(num_reqs, dtype=torch.int32)),
            "draft_ids": torch.full((num_reqs, 1), 3, dtype=torch.int32),
            "num_drafts": torch.ones(num_reqs, dtype=torch.int32), "temperature": torch.ones(num_reqs),
            "seeds": torch.arange(num_reqs, dtype=torch.int64) * 104729 + 1,
            "positions": torch.arange(num_reqs, dtype=torch.int64) * 3}
    u = _accept_uniform_ref(args["seeds"], args["positions"]).double()  # [B] the acceptance uniforms
    clear = (u - p_d).abs() > 1e-4  # float32 rounding may decide a near tie either way
    want = (u < p_d)[clear]
    assert 0 < int(want.sum()) < int(clear.sum())  # both outcomes occur
    args = {key: v.to(DEVICE) for key, v in args.items()}
    for name, (_, acc) in (("reference", rejection_sample_ref(**args, draft_probs=None)),
                           ("one program per request", rejection_sample_triton(**args, draft_probs=None)),
                           ("split", rejection_sample_split_triton(**args))):
        assert torch.equal(acc.cpu()[clear] == 1, want), name


def _oracle_greedy(logits: list[list[float]], cu: list[int], drafts: list[list[int]], nd: list[int]):
    out, acc = [], []
    for b in range(len(nd)):
        toks, j = [], 0
        while True:
            row = logits[cu[b] + j]
            best = row.index(max(row))  # lowest index on ties
            if j < nd[b] and drafts[b][j] == best:
                toks.append(best)
                j += 1
                continue
            toks.append(best)
            break
        acc.append(j)
        out.append(toks + [-1] * (len(drafts[b]) + 1 - len(toks)))
    return out, acc


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("vocab", [11, 5003])
def test_greedy_matches_python_oracle(vocab: int, use_triton: bool) -> None:
    g = torch.Generator().manual_seed(vocab)
    num_reqs, k = 6, 3
    num_drafts = torch.tensor([0, 1, 3, 3, 2, 3], dtype=torch.int32)
    cu = _cu(num_drafts)
    n = int(cu[-1])
    logits = torch.randint(-3, 3, (n, vocab), generator=g).float()  # many ties: the lowest index must win
    logits[:, vocab - 1] = 2.0  # a tie at the far end (in the second block when vocab > 4096)
    draft_ids = torch.zeros(num_reqs, k, dtype=torch.int32)
    for b in range(num_reqs):
        for j in range(k):
            row = int(cu[b]) + min(j, int(num_drafts[b]))
            best = int(logits[row].argmax())
            draft_ids[b, j] = best if (b + j) % 4 != 3 else (best + 1) % vocab  # mostly right, sometimes wrong
    zeros_f, zeros_i = torch.zeros(num_reqs), torch.zeros(num_reqs, dtype=torch.int64)
    out, acc = rejection_sample(*(t.to(DEVICE) for t in (logits, cu, draft_ids, num_drafts)), None,
                                *(t.to(DEVICE) for t in (zeros_f, zeros_i, zeros_i)), use_triton=use_triton)
    want_out, want_acc = _oracle_greedy(logits.tolist(), cu.tolist(), draft_ids.tolist(), num_drafts.tolist())
    assert out.cpu().tolist() == want_out
    assert acc.cpu().tolist() == want_acc
    assert 0 < sum(want_acc) < int(num_drafts.sum())  # both outcomes occur


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("vocab", [7, 5003])
def test_rows_without_drafts_equal_gumbel_sample(vocab: int, use_triton: bool) -> None:
    """A request with no drafts, and the bonus row of a request that accepted all its drafts, sample exactly what
    graphrunner.sampling.gumbel samples for the same (seed, position)."""
    args = _batch(8, 2, vocab, with_q=False, seed=vocab + 7)
    args["positions"] = args["positions"] % 2**30  # sample() takes int32 positions
    out, acc = rejection_sample(**args, use_triton=use_triton)
    nd, cu = args["num_drafts"].long(), args["cu_num_logits"].long()
    bonus = cu[1:] - 1  # [B] the bonus row of each request
    direct = torch.arange(nd.shape[0], dtype=torch.int32, device=DEVICE)
    want = sample(args["logits"][bonus], direct, args["temperature"], args["seeds"],
                  (args["positions"] + nd).to(torch.int32), use_triton)
    all_acc = acc.long() == nd
    got = out.gather(1, nd[:, None])[:, 0]
    assert torch.equal(got[all_acc], want[all_acc])
    assert bool(all_acc[nd == 0].all()) and int((all_acc & (nd > 0)).sum()) > 0


def _spec_batch(num_reqs: int, p: torch.Tensor, temp: float, draft_probs: torch.Tensor, one_hot: bool) -> dict:
    """num_reqs requests of K = 2 drafts each; the target is p at every row (logits log(p) * temp)."""
    g = torch.Generator().manual_seed(12345)
    k, vocab = 2, p.shape[0]
    num_drafts = torch.full((num_reqs,), k, dtype=torch.int32)
    logits = (torch.log(p) * temp).expand(num_reqs * (k + 1), vocab).contiguous()
    draft_ids = torch.multinomial(draft_probs, num_reqs * k, replacement=True, generator=g).view(num_reqs, k)
    q = None if one_hot else draft_probs.expand(num_reqs * k, vocab).contiguous()
    return {"logits": logits, "cu_num_logits": _cu(num_drafts), "draft_ids": draft_ids.to(torch.int32),
            "num_drafts": num_drafts, "draft_probs": q, "temperature": torch.full((num_reqs,), temp),
            "seeds": torch.arange(num_reqs, dtype=torch.int64) * 7919 + 3,
            "positions": torch.randint(0, 10**6, (num_reqs,), generator=g, dtype=torch.int64)}


@pytest.mark.parametrize("one_hot", [True, False], ids=["ngram", "draft_model"])
def test_emitted_tokens_follow_target(one_hot: bool) -> None:
    """Over 20k seeded requests: the first emitted token, and the second where the first draft was accepted, follow
    p (chi-square); the accept rates match sum_x min(p(x), q(x)) (one-hot q: E_d[p(d)]) and its square."""
    num_reqs = 20_000
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.07, 0.03])
    q = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0]) / 6 if one_hot else torch.tensor([0.1, 0.4, 0.05, 0.2, 0.2, 0.05])
    args = _spec_batch(num_reqs, p, 0.8, q, one_hot)
    out, acc = rejection_sample_ref(**args)
    for tokens in (out[:, 0], out[acc >= 1, 1]):
        observed = torch.bincount(tokens.long(), minlength=6).double()
        expected = p.double() / p.double().sum() * observed.sum()
        assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > P_THRESHOLD
    alpha = float((p * q).sum()) if one_hot else float(torch.minimum(p, q).sum())
    for rate, want in ((float((acc >= 1).float().mean()), alpha), (float((acc >= 2).float().mean()), alpha**2)):
        assert abs(rate - want) < 4.5 * math.sqrt(want * (1 - want) / num_reqs), (rate, want)
    # The Triton kernel decides the same on a slice of the batch (interpreter speed bounds its size).
    m = 64 if DEVICE == "cpu" else num_reqs
    small = dict(args, cu_num_logits=args["cu_num_logits"][:m + 1], draft_ids=args["draft_ids"][:m],
                 num_drafts=args["num_drafts"][:m], temperature=args["temperature"][:m], seeds=args["seeds"][:m],
                 positions=args["positions"][:m])
    small = {key: v.to(DEVICE) if v is not None else None for key, v in small.items()}
    out_tri, acc_tri = rejection_sample_triton(**small)
    assert torch.equal(out_tri.cpu(), out[:m]) and torch.equal(acc_tri.cpu(), acc[:m])
    if one_hot:
        out_split, acc_split = rejection_sample_split_triton(**{key: v for key, v in small.items()
                                                                if key != "draft_probs"})
        assert torch.equal(out_split.cpu(), out[:m]) and torch.equal(acc_split.cpu(), acc[:m])


def test_seeded_results_do_not_depend_on_the_batch() -> None:
    args = _batch(5, 3, 50, with_q=True, seed=3)
    out, acc = rejection_sample_ref(**args)
    cu = args["cu_num_logits"]
    for b in (1, 3, 4):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        dstart = int(cu[b]) - b
        one = {"logits": args["logits"][rows], "cu_num_logits": (cu[b:b + 2] - cu[b]).contiguous(),
               "draft_ids": args["draft_ids"][b:b + 1], "num_drafts": args["num_drafts"][b:b + 1],
               "draft_probs": args["draft_probs"][dstart:dstart + int(args["num_drafts"][b])],
               "temperature": args["temperature"][b:b + 1], "seeds": args["seeds"][b:b + 1],
               "positions": args["positions"][b:b + 1]}
        o1, a1 = rejection_sample_ref(**one)
        assert torch.equal(o1[0], out[b]) and int(a1[0]) == int(acc[b])


def test_bad_arguments_raise() -> None:
    args = _batch(2, 2, 9, with_q=True, seed=0)
    with pytest.raises(ValueError, match="draft_ids"):
        rejection_sample(**dict(args, draft_ids=args["draft_ids"].long()), use_triton=False)
    with pytest.raises(ValueError, match="cu_num_logits"):
        rejection_sample(**dict(args, cu_num_logits=args["cu_num_logits"][:2]), use_triton=True)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(**dict(args, draft_probs=args["draft_probs"][:, :4]), use_triton=False)


@pytest.mark.parametrize("use_triton", [False, True])
def test_empty_residual_falls_back_to_target_sample(use_triton: bool) -> None:
    """With q = 2p (not normalised) max(0, p - q) is empty: a rejected row samples p itself, as gumbel.sample does."""
    args = _batch(6, 2, 300, with_q=True, seed=11)
    args["num_drafts"] = torch.full((6,), 2, dtype=torch.int32, device=DEVICE)
    args["cu_num_logits"] = _cu(args["num_drafts"].cpu()).to(DEVICE)
    args["temperature"] = torch.full((6,), 0.9, device=DEVICE)
    args["positions"] = args["positions"] % 2**30  # sample() takes int32 positions
    draft_rows = torch.arange(18, device=DEVICE).view(6, 3)[:, :2].reshape(-1)
    args["logits"] = (torch.randn(18, 300, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE)
    args["draft_probs"] = 2 * torch.softmax(args["logits"][draft_rows] / 0.9, dim=-1)
    out, acc = rejection_sample(**args, use_triton=use_triton)
    stop_rows = args["cu_num_logits"][:-1].long() + acc.long()  # [B] the row each request stopped at
    want = sample(args["logits"][stop_rows], torch.arange(6, dtype=torch.int32, device=DEVICE), args["temperature"],
                  args["seeds"], (args["positions"] + acc.long()).to(torch.int32), use_triton)
    assert torch.equal(out.gather(1, acc.long()[:, None])[:, 0], want)
    assert int((acc < 2).sum()) > 0  # some rejection happened
