"""Tests for graphrunner.sampling.gumbel_split: the vocab-split Gumbel-max kernel == gumbel.sample_ref and the
row-per-program kernel token for token (awkward vocab sizes, ties across chunks, NaN/inf rows, empty batch), its
non-finite flags == ~isfinite(logits).all(-1), and run_sampler's fused path == the unfused one.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (a few chunks per row there too).
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.sampling import gumbel_split
from graphrunner.sampling.batch import RequestSampling, SampleEntry, build_sampling_batch
from graphrunner.sampling.gumbel import sample_ref, sample_rowwise_triton
from graphrunner.sampling.gumbel_split import sample_split_ref, sample_split_triton, split_plan
from graphrunner.sampling.sampler import run_sampler
from graphrunner.sampling_params import SamplingParams
from graphrunner.state_table import StateTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(num_reqs: int, vocab: int, seed: int, temps: tuple[float, ...] = (0.0, 0.3, 1.0, 1.7)):
    """Random logits plus per-row tables of R = num_reqs + 3 rows, addressed through a shuffled idx_mapping."""
    g = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + 3
    logits = torch.randn(num_reqs, vocab, generator=g) * 3
    idx = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    choices = torch.tensor(temps)
    temperature = choices[torch.randint(0, len(choices), (num_rows,), generator=g)].float()
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=g, dtype=torch.int64)
    num_tokens = torch.randint(0, 5000, (num_rows,), generator=g, dtype=torch.int32)
    return [t.to(DEVICE) for t in (logits, idx, temperature, seeds, num_tokens)]


@pytest.fixture(params=["one launch", "reduce kernel"], autouse=True)
def reduction(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with the in-kernel (last program reduces) and the separate-kernel reduction."""
    monkeypatch.setattr(gumbel_split, "SPLIT_SAMPLE_SERIAL", request.param == "one launch")
    return request.param


@pytest.mark.parametrize(("num_reqs", "vocab"), [(1, 1), (1, 999), (1, 4097), (7, 1025), (3, 5000), (2, 3 * 1024)])
def test_split_matches_reference_and_rowwise(num_reqs: int, vocab: int) -> None:
    args = _batch(num_reqs, vocab, seed=vocab + num_reqs)
    tokens, nonfinite = sample_split_triton(*args)
    ref_tokens, ref_nonfinite = sample_split_ref(*args)
    assert tokens.dtype == torch.int32 and tokens.shape == (num_reqs,) and nonfinite.dtype == torch.bool
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(tokens, sample_rowwise_triton(*args))
    assert torch.equal(nonfinite, ref_nonfinite) and not nonfinite.any()


@pytest.mark.parametrize("num_reqs", [1, 4, 100, 10_000])
@pytest.mark.parametrize("vocab", [1, 1000, 1025, 151_936, 2_000_000])
def test_split_plan_covers_the_vocab(num_reqs: int, vocab: int) -> None:
    chunk, num_chunks = split_plan(num_reqs, vocab, torch.device(DEVICE))
    assert chunk % 1024 == 0 and chunk > 0
    assert 1 <= num_chunks <= 1024
    assert (num_chunks - 1) * chunk < vocab <= num_chunks * chunk  # every chunk non-empty, none missing


def test_split_plan_uses_many_chunks_at_batch_one() -> None:
    chunk, num_chunks = split_plan(1, 151_936, torch.device(DEVICE))
    assert num_chunks > 1 and chunk < 151_936


def test_ties_across_chunks_keep_the_lowest_index() -> None:
    vocab = 4097  # 5 chunks of 1024 at batch 1 in the interpreter
    logits = torch.zeros(4, vocab, device=DEVICE)
    logits[0, [4096, 2048, 1030]] = 5.0  # last, middle and early chunk
    logits[1, [3000, 3001]] = 2.0  # same chunk
    logits[2, :] = -1.0  # all equal: token 0
    logits[3, [1024, 1023]] = 7.0  # either side of a chunk boundary
    idx = torch.arange(4, dtype=torch.int32, device=DEVICE)
    tables = (torch.zeros(4, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE),
              torch.zeros(4, dtype=torch.int32, device=DEVICE))
    for chunks in ((1, 4), (4, 4)):  # batch of 1 (many chunks) and of 4
        rows = slice(*((0, 4) if chunks[0] == 4 else (0, 1)))
        tokens, _ = sample_split_triton(logits[rows], idx[rows], *tables)
        assert tokens.tolist() == [1030, 3000, 0, 1023][rows]


def test_nonfinite_rows_are_flagged_and_get_a_valid_token() -> None:
    vocab = 3001
    logits, idx, temperature, seeds, num_tokens = _batch(6, vocab, seed=5)
    logits[0, 17] = float("nan")
    logits[1, 2999] = float("inf")
    logits[2, :] = float("nan")
    logits[3, 5] = float("-inf")
    logits[4, :] = float("-inf")
    tokens, nonfinite = sample_split_triton(logits, idx, temperature, seeds, num_tokens)
    assert nonfinite.tolist() == [True, True, True, True, True, False]
    assert ((tokens >= 0) & (tokens < vocab)).all()
    assert int(tokens[1]) == 2999  # +inf wins, greedy or sampled
    assert int(tokens[4]) == 0  # nothing finite: the lowest index, as the row-per-program kernel gives
    assert int(tokens[4]) == int(sample_rowwise_triton(logits, idx, temperature, seeds, num_tokens)[4])
    ref_tokens = sample_ref(logits, idx, temperature, seeds, num_tokens)
    assert torch.equal(tokens[[1, 3, 5]], ref_tokens[[1, 3, 5]])  # rows without NaN agree with the reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_strided_logits(dtype: torch.dtype) -> None:
    logits, *rest = _batch(3, 2050, seed=9)
    wide = torch.full((3, 2100), 1e4, device=DEVICE, dtype=dtype)
    wide[:, :2050] = logits.to(dtype)
    tokens, nonfinite = sample_split_triton(wide[:, :2050], *rest)
    assert torch.equal(tokens, sample_ref(wide[:, :2050].float(), *rest)) and not nonfinite.any()


def test_one_launch_counters_reset_themselves(reduction: str) -> None:
    args = _batch(5, 4100, seed=12)
    first = sample_split_triton(*args)
    for _ in range(3):  # repeated launches (graph replays) see zeroed counters
        again = sample_split_triton(*args)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    if reduction == "one launch":
        assert not gumbel_split._counters[args[0].device].any()


def test_empty_batch_and_bad_input() -> None:
    logits = torch.zeros(0, 10, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    tables = (torch.ones(3, device=DEVICE), torch.ones(3, dtype=torch.int64, device=DEVICE),
              torch.zeros(3, dtype=torch.int32, device=DEVICE))
    tokens, nonfinite = sample_split_triton(logits, empty, *tables)
    assert tokens.shape == nonfinite.shape == (0,)
    with pytest.raises(ValueError, match="idx_mapping"):
        sample_split_triton(torch.zeros(2, 10, device=DEVICE), empty, *tables)


SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.9},
    "greedy+logprobs": {"temperature": 0.0, "logprobs": 2},
    "temperature+logprobs": {"temperature": 0.9, "logprobs": 2},
    "top-k": {"temperature": 0.9, "top_k": 5},
    "penalties": {"temperature": 0.9, "repetition_penalty": 1.3},
}


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_run_sampler_fused_check_equals_unfused(setting: str, logprobs_mode: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tokens, flags and logprobs with the split kernel's fused NaN check on and off (and vs the references)."""
    bs, vocab = 3, 1500
    device = torch.device(DEVICE)
    state = StateTable(bs, 64, 4, device, True, vocab)
    params = SamplingParams(max_tokens=1, seed=3, **SETTINGS[setting])  # type: ignore[arg-type]
    for r in range(bs):
        state.stage_new_row(r, [(r * 7 + i) % vocab for i in range(20)], 10, 0, params, r + 11)
    state.apply_staged()
    idx = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    sbatch = build_sampling_batch([SampleEntry(r, params, RequestSampling(), 0) for r in (2, 0, 1)], idx, device)
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(1)).to(device) * 3
    logits[1, 7] = float("nan")
    results = []
    for split, use_triton in ((True, True), (False, True), (True, False)):
        monkeypatch.setattr(gumbel_split, "SPLIT_SAMPLE_ENABLED", split)
        results.append(run_sampler(logits.clone(), sbatch, state, use_triton, logprobs_mode))
    for other in results[1:]:
        assert torch.equal(results[0].nonfinite, other.nonfinite)
        assert results[0].nonfinite.tolist() == [False, True, False]
        keep = torch.tensor([0, 2], device=device)  # the NaN row's token is unspecified (the request errors)
        assert torch.equal(results[0].sampled[keep], other.sampled[keep])
        if results[0].logprobs is None:
            assert other.logprobs is None
        else:
            assert other.logprobs is not None
            for name in ("top_ids", "top_logprobs", "token_logprob", "token_rank"):
                ours, theirs = getattr(results[0].logprobs, name), getattr(other.logprobs, name)
                torch.testing.assert_close(ours[keep], theirs[keep])


@pytest.mark.parametrize("vocab", [1, 1000, 1025, 151_936, 2_000_000])
def test_chunk_pad_covers_every_batch_size(vocab: int) -> None:
    """One C_PAD per vocabulary (no new compiled variant per batch size) that holds every split_plan's chunks."""
    pad = gumbel_split.chunk_pad(vocab)
    for num_reqs in (1, 2, 3, 5, 8, 33, 256, 1024):
        chunk, num_chunks = gumbel_split.split_plan(num_reqs, vocab, torch.device("cpu"))
        assert 1 <= num_chunks <= pad and chunk * num_chunks >= vocab and pad >= 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_reqs, vocab", [(1, 1), (1, 4096), (5, 3001), (3, 1025)])
def test_greedy_argmax_equals_torch_argmax(dtype: torch.dtype, num_reqs: int, vocab: int) -> None:
    """The model proposers' draft pick: the split kernel at temperature 0 straight from model-dtype logits (a
    column slice of a wider, padded tensor, as the LM head's shard gives) equals torch.argmax of the float32 copy,
    lowest index on ties (coarse values make ties across chunks common)."""
    g = torch.Generator().manual_seed(num_reqs * 31 + vocab)
    wide = (torch.randint(-40, 40, (num_reqs, vocab + 3), generator=g).float() / 8).to(dtype).to(DEVICE)
    logits = wide[:, :vocab]
    want = logits.float().argmax(dim=-1)
    got = gumbel_split.greedy_argmax(logits, use_triton=True)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert torch.equal(gumbel_split.greedy_argmax(logits, use_triton=False), want)
