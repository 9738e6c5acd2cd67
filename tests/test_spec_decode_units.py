"""Speculative decoding's pieces on their own: the config (vLLM's dict, CLI flags, clear refusals), the verify
step's logits-row layout, and the device state updates, against plain Python loops on awkward sizes.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch

from graphrunner import cli
from graphrunner.engine_args import EngineArgs, build_engine_config
from graphrunner.penalty_counts import PenaltyCounts
from graphrunner.spec_config import SpeculativeConfig
from graphrunner.spec_decode.draft_observe import observe_counts, observe_counts_ref
from graphrunner.spec_decode.eagle_observe import observe_index, observe_index_ref
from graphrunner.spec_decode.layout import build_spec_layout, uniform_spec_layout
from graphrunner.spec_decode.update import advance_draft, post_update_spec, read_drafts, write_drafts

# the state-update kernels run on CUDA where there is one, else in Triton's interpreter (tests/conftest.py)
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# -- config ---------------------------------------------------------------------------------------------------


def test_config_from_vllm_dict() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, None)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                     "disable_by_batch_size": 8})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (2, 2, 8)
    c = SpeculativeConfig.from_dict({"method": "eagle", "model": Path("/heads/x"), "num_speculative_tokens": 4})
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle", "/heads/x", 4)


@pytest.mark.parametrize("raw, words", [
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "not supported"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' needs it"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method 'draft_model' needs it"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "/x"}, "method 'ngram' takes none"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "positive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
    ([1, 2], "dict"),
])
def test_config_refusals(raw: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.from_dict(raw)


def test_engine_arguments_and_cli_flags() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert build_engine_config(speculative_config=spec).speculative == SpeculativeConfig("ngram", 3, 4, 4)
    assert build_engine_config().speculative is None
    with pytest.raises(ValueError, match="not valid JSON"):
        build_engine_config(speculative_config="{nope")
    flag = '{"method": "ngram", "num_speculative_tokens": 2}'
    args = cli.build_parser().parse_args(["generate", "--speculative-config", flag, "x"])
    assert EngineArgs(**cli.engine_kwargs(args)).create_engine_config().speculative.num_speculative_tokens == 2
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())  # vLLM's engine-argument flags
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert EngineArgs.from_cli_args(ns).create_engine_config().speculative.num_speculative_tokens == 5


# -- layout and state updates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_spec", [[], [0], [3], [0, 2, 0, 5, 1], [4] * 7])
def test_layout_matches_a_loop(num_spec: list[int]) -> None:
    rng = random.Random(len(num_spec))
    counts = [s + 1 if s else rng.randrange(1, 9) for s in num_spec]
    rows = rng.sample(range(50), len(num_spec))
    lay = build_spec_layout(rows, counts, num_spec, torch.device("cpu"))
    li, ex, req, jj, cu, end = [], [], [], [], [0], 0
    for b, (r, n, s) in enumerate(zip(rows, counts, num_spec)):
        end += n
        for j in range(s + 1):
            li.append(end - 1 - s + j)
            ex.append(r)
            req.append(b)
            jj.append(j)
        cu.append(cu[-1] + s + 1)
    assert lay.logits_indices.tolist() == li and lay.expanded_idx.tolist() == ex
    assert lay.row_req.tolist() == req and lay.row_j.tolist() == jj and lay.cu_num_logits.tolist() == cu
    assert lay.first_row == tuple(cu[:-1]) and lay.num_logits == cu[-1] and lay.num_spec.tolist() == num_spec
    with pytest.raises(ValueError, match="draft slots"):
        build_spec_layout([0], [2], [2], torch.device("cpu"))


def test_uniform_layout_equals_the_host_layout() -> None:
    k, rows = 3, [7, 2, 9, 4, 4]
    counts = [4, 4, 4, 0, 0]  # two padding requests (0 tokens) pointing at one padding row
    lay = uniform_spec_layout(torch.tensor(rows, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32), k)
    host = build_spec_layout(rows[:3], counts[:3], [k] * 3, torch.device("cpu"))
    n = host.num_logits
    assert lay.num_spec.tolist() == [3, 3, 3, 0, 0]
    for name in ("logits_indices", "expanded_idx", "row_req", "row_j"):
        assert getattr(lay, name)[:n].tolist() == getattr(host, name).tolist(), name
    assert lay.cu_num_logits[:4].tolist() == host.cu_num_logits.tolist()


def _state(rng: random.Random, num_rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tok = torch.tensor([[rng.randrange(100) for _ in range(width)] for _ in range(num_rows)], dtype=torch.int32)
    nt = torch.tensor([rng.randrange(1, width + 1) for _ in range(num_rows)], dtype=torch.int32)
    nc = (nt - 1).clamp(min=0)
    return tok, nt, nc


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("num_reqs, k, width", [(0, 3, 9), (1, 1, 5), (5, 3, 11), (7, 5, 13)])
def test_post_update_spec_matches_a_loop(num_reqs: int, k: int, width: int, use_triton: bool) -> None:
    rng = random.Random(num_reqs * 31 + k)
    tok, nt, nc = _state(rng, 9, width)
    rows = rng.sample(range(9), num_reqs)
    sched, spec, acc, out = [], [], [], []
    for r in rows:
        s = rng.randrange(k + 1)
        partial = rng.random() < 0.2  # a prefill chunk that does not reach the row's end
        if partial:
            nc[r] = max(0, int(nt[r]) - 5)
            s, n = 0, min(2, int(nt[r] - nc[r]) - 1) if nt[r] - nc[r] > 1 else 0
        else:
            n = 1 + s
        a = rng.randrange(s + 1)
        sched.append(n)
        spec.append(s)
        acc.append(a)
        out.append([rng.randrange(100) for _ in range(a + 1)] + [-1] * (k - a))
    want_tok, want_nt, want_nc = tok.clone(), nt.clone(), nc.clone()
    for r, n, s, a, o in zip(rows, sched, spec, acc, out):
        new_nc = int(want_nc[r]) + n - s + a
        want_nc[r] = new_nc
        if new_nc >= int(want_nt[r]):
            for t in o[:a + 1]:
                if want_nt[r] < width:
                    want_tok[r, want_nt[r]] = t
                    want_nt[r] += 1
    dev = KERNEL_DEVICE if use_triton else torch.device("cpu")
    i32 = {"dtype": torch.int32, "device": dev}
    out_t = torch.tensor(out, **i32).view(num_reqs, k + 1)
    tok, nc, nt = tok.to(dev), nc.to(dev), nt.to(dev)
    post_update_spec(torch.tensor(rows, **i32), torch.tensor(sched, **i32), torch.tensor(spec, **i32), out_t,
                     torch.tensor(acc, **i32), tok, nc, nt, None, use_triton)
    assert torch.equal(tok.cpu(), want_tok) and torch.equal(nt.cpu(), want_nt) and torch.equal(nc.cpu(), want_nc)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("num_reqs, k, width", [(0, 2, 7), (1, 3, 6), (6, 5, 10), (3, 1, 4)])
def test_write_and_read_drafts_match_a_loop(num_reqs: int, k: int, width: int, use_triton: bool) -> None:
    rng = random.Random(num_reqs + 7 * k)
    tok, nt, _ = _state(rng, 8, width)
    row_nd = torch.full((8,), 9, dtype=torch.int32)
    rows = rng.sample(range(8), num_reqs)
    nd = [rng.randrange(k + 1) for _ in rows]
    drafts = [[rng.randrange(100) if j < n else -1 for j in range(k)] for n in nd]
    want_tok, want_nd = tok.clone(), row_nd.clone()
    for r, n, d in zip(rows, nd, drafts):
        m = min(n, width - int(nt[r]))
        for j in range(m):
            want_tok[r, int(nt[r]) + j] = d[j]
        want_nd[r] = m
    dev = KERNEL_DEVICE if use_triton else torch.device("cpu")
    i32 = {"dtype": torch.int32, "device": dev}
    idx = torch.tensor(rows, **i32)
    tok, nt, row_nd = tok.to(dev), nt.to(dev), row_nd.to(dev)
    write_drafts(idx, torch.tensor(drafts, **i32).view(num_reqs, k), torch.tensor(nd, **i32), tok, nt, row_nd,
                 use_triton)
    assert torch.equal(tok.cpu(), want_tok) and torch.equal(row_nd.cpu(), want_nd)
    num_spec = torch.tensor([rng.randrange(k + 1) for _ in rows], **i32)
    got, got_n = read_drafts(idx, num_spec, k, tok, nt, row_nd, use_triton)
    got, got_n = got.cpu(), got_n.cpu()
    for b, r in enumerate(rows):
        assert int(got_n[b]) == min(int(num_spec[b]), int(want_nd[r]))
        for j in range(int(want_nd[r])):
            assert int(got[b, j]) == drafts[b][j]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("num_reqs, k, width, dtype", [(0, 2, 6, torch.int64), (1, 1, 5, torch.int64),
                                                       (5, 4, 9, torch.int32), (9, 7, 11, torch.int64)])
def test_draft_steps_advance_matches_a_loop(num_reqs: int, k: int, width: int, dtype: torch.dtype,
                                            use_triton: bool) -> None:
    """k draft steps' advances (the model proposers' argmax ids, int64 or int32) against a loop: each draft lands
    at num_tokens + i where the row has room, the next position is num_computed + i + 1 clamped to the last column,
    and the row's draft count is what fits; rows near the end of their history and a padding entry that repeats a
    row (writing the same values) included."""
    rng = random.Random(num_reqs * 17 + k)
    num_rows = num_reqs + 3
    tok, nt, nc = _state(rng, num_rows, width)
    nt[0], nc[0] = width, width - 1  # a row at max_model_len: nothing fits
    rows = rng.sample(range(num_rows), num_reqs)
    rows += rows[-1:]  # padding: the last row again, with the same draft
    drafts = [[rng.randrange(100) for _ in range(k)] for _ in rows[:num_reqs]]
    drafts += drafts[-1:]
    want_tok, want_pos, want_nd = tok.clone(), nc.clone(), torch.full((num_rows,), 9, dtype=torch.int32)
    for r, d in zip(rows, drafts):
        for i in range(k):
            if int(nt[r]) + i < width:
                want_tok[r, int(nt[r]) + i] = d[i]
        want_pos[r] = min(int(nc[r]) + k, width - 1)
        want_nd[r] = max(0, min(k, width - int(nt[r])))
    dev = KERNEL_DEVICE if use_triton else torch.device("cpu")
    idx = torch.tensor(rows, dtype=torch.int32, device=dev)
    tok, nt, nc = tok.to(dev), nt.to(dev), nc.to(dev)
    pos, row_nd = nc.clone(), torch.full((num_rows,), 9, dtype=torch.int32, device=dev)
    for i in range(k):
        step_tokens = torch.tensor([d[i] for d in drafts], dtype=dtype, device=dev).view(len(rows))
        advance_draft(idx, i, i + 1, step_tokens, tok, nc, nt, pos, row_nd, use_triton)
    assert torch.equal(tok.cpu(), want_tok)
    assert torch.equal(pos.cpu()[rows], want_pos[rows]) and torch.equal(row_nd.cpu()[rows], want_nd[rows])
    untouched = [r for r in range(num_rows) if r not in rows]
    assert torch.equal(pos.cpu()[untouched], nc.cpu()[untouched]) and bool((row_nd.cpu()[untouched] == 9).all())


@pytest.mark.parametrize("num_reqs, k, vocab", [(1, 1, 7), (5, 3, 33), (9, 7, 50)])
def test_post_update_spec_triton_equals_reference_with_counts_and_padding(num_reqs: int, k: int, vocab: int) -> None:
    """The Triton update against the reference on one state, output counts included (rows with and without a
    penalty, repeated tokens in a run, ids outside the vocabulary), with two padding entries that share one row
    and schedule nothing, as a captured batch's padding does."""
    rng = random.Random(num_reqs * 13 + k)
    num_rows, width = num_reqs + 2, 3 * k + 4
    pad = num_rows - 1
    tok, nt, nc = _state(rng, num_rows, width)
    nt[pad], nc[pad] = 1, 0
    rows = rng.sample(range(num_rows - 1), num_reqs) + [pad, pad]
    spec = [rng.randrange(k + 1) for _ in range(num_reqs)] + [0, 0]
    sched = [1 + s for s in spec[:num_reqs]] + [0, 0]
    acc = [rng.randrange(s + 1) for s in spec[:num_reqs]] + [0, 0]
    out = [[rng.choice([rng.randrange(vocab), 3, vocab + 2, -1]) if j <= a else -1 for j in range(k + 1)]
           for a in acc]
    rep = torch.tensor([rng.choice([1.0, 1.3]) for _ in range(num_rows)])
    pres, freq = torch.zeros(num_rows), torch.tensor([rng.choice([0.0, 0.5]) for _ in range(num_rows)])
    results = []
    for use_triton in (False, True):
        dev = KERNEL_DEVICE if use_triton else torch.device("cpu")
        i32 = {"dtype": torch.int32, "device": dev}
        pen = PenaltyCounts(torch.zeros(num_rows, vocab, **i32), torch.zeros(num_rows, 1, **i32), rep.to(dev),
                            pres.to(dev), freq.to(dev))
        state = (tok.clone().to(dev), nc.clone().to(dev), nt.clone().to(dev))
        post_update_spec(torch.tensor(rows, **i32), torch.tensor(sched, **i32), torch.tensor(spec, **i32),
                         torch.tensor(out, **i32).view(-1, k + 1), torch.tensor(acc, **i32), *state, pen, use_triton)
        results.append([t.cpu() for t in (*state, pen.output_counts)])
    for name, want, got in zip(("token_ids", "num_computed", "num_tokens", "output_counts"), *results):
        assert torch.equal(want, got), name
    assert int(results[0][3].sum()) > 0  # the case counted something


@pytest.mark.parametrize("counts, pad", [([1], 0), ([5], 0), ([3, 0, 7, 1], 2), ([1] * 9, 3), ([70, 2, 65], 5)])
def test_eagle_observe_index_triton_equals_reference(counts: list[int], pad: int) -> None:
    """The EAGLE observation's maps (each position's next token, each request's last accepted position) from one
    launch against the PyTorch reference: empty requests, padding positions past the last request, prefill chunks
    longer than the kernel's block, rows that accepted nothing / some / all of their tokens, positions at the last
    column."""
    rng = random.Random(sum(counts) * 7 + pad)
    num_rows, width = len(counts) + 4, 80
    token_ids = torch.tensor([[rng.randrange(1000) for _ in range(width)] for _ in range(num_rows)], dtype=torch.int32)
    rows = rng.sample(range(num_rows), len(counts))
    positions: list[int] = []
    num_computed = torch.zeros(num_rows, dtype=torch.int32)
    for r, n in zip(rows, counts):
        start = rng.randrange(0, width - n + 1)
        positions += range(start, start + n)
        num_computed[r] = start + rng.randrange(0, n + 1)  # accepted so far: none to all of the scheduled ones
    if counts[-1]:
        positions[-1] = width - 1  # its next token is clamped to the last column
    positions += [0] * pad
    qsl = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))], dtype=torch.int32)
    args = (torch.tensor(rows, dtype=torch.int32), qsl, torch.tensor(positions, dtype=torch.int64), token_ids,
            num_computed)
    want = observe_index_ref(*args)
    got = observe_index(*(a.to(KERNEL_DEVICE) for a in args), use_triton=True)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    with pytest.raises(ValueError, match="requests and tokens"):
        observe_index(*(a[:0] if i in (0, 2) else a for i, a in enumerate(args)), use_triton=True)


def _loop_observe_counts(rows: list[int], counts: list[int], starts: list[int], num_computed: list[int],
                         max_len: int, total: int) -> tuple[list[int], list[int]]:
    """Plain-Python counts and indices of the draft model's observation (one more token a request, cut at max_len;
    the index of each request's num_computed in it)."""
    obs, last, first = [], [], 0
    for r, n, s in zip(rows, counts, starts):
        c = min(n + 1, max_len - s) if n else 0
        last.append(min(first + min(max(num_computed[r] - s, 0), max(c - 1, 0)), total - 1))
        obs.append(c)
        first += c
    return obs, last


@pytest.mark.parametrize("counts, pad", [([1], 0), ([4], 3), ([3, 0, 7, 1], 2), ([5] * 9, 0), ([70, 2, 65], 5),
                                         ([1, 4] * 70, 0)])
def test_draft_observe_counts_triton_equals_reference(counts: list[int], pad: int) -> None:
    """The draft model's observation map (each request's tokens + 1, its first position, the index of its new
    num_computed) from one launch against the PyTorch reference and a plain loop: requests without tokens (a
    captured graph's padding rows), padding positions, more requests than the kernel's prefix-sum block, verify rows
    that accepted none / some / all of their drafts, prefill chunks, and requests whose next position would pass
    max_len (their count is cut there)."""
    rng = random.Random(sum(counts) * 11 + pad)
    num_rows, width = len(counts) + 3, 80
    rows = rng.sample(range(num_rows), len(counts))
    starts, positions = [], []
    num_computed = [0] * num_rows
    for i, (r, n) in enumerate(zip(rows, counts)):
        start = width - n if i % 5 == 2 else rng.randrange(0, width - n + 1)  # some end at the last column
        starts.append(start)
        positions += range(start, start + n)
        num_computed[r] = start + rng.randrange(1, n + 1) if n else rng.randrange(width)
    positions += [0] * pad
    t = len(positions)
    qsl = [0]
    for n in counts:
        qsl.append(qsl[-1] + n)
    i32 = {"dtype": torch.int32}
    args = (torch.tensor(rows, **i32), torch.tensor(qsl, **i32), torch.tensor(positions, dtype=torch.int64),
            torch.tensor(num_computed, **i32))
    want_obs, want_last = _loop_observe_counts(rows, counts, starts, num_computed, width, t + len(rows))
    want_starts = [-1] * num_rows
    for r, n, s in zip(rows, counts, starts):
        if n:
            want_starts[r] = s
    for use_triton in (False, True):
        dev = KERNEL_DEVICE if use_triton else torch.device("cpu")
        row_starts = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
        got = observe_counts(*(a.to(dev) for a in args), row_starts, width, use_triton)
        assert got[0].cpu().tolist() == want_obs and got[1].cpu().tolist() == want_last, use_triton
        assert row_starts.cpu().tolist() == want_starts, use_triton
    ref = observe_counts_ref(*args, torch.full((num_rows,), -1, **i32), width)
    assert ref[0].tolist() == want_obs
    with pytest.raises(ValueError, match="requests and tokens"):
        observe_counts(args[0][:0], args[1][:1], *args[2:], row_starts.cpu(), width, False)
