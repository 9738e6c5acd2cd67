"""Tests for graphrunner.sampling.vocab_parallel: the vocabulary split into W shards, each shard's Gumbel-max pick
(PyTorch reference and Triton kernel) combined across the shards gives exactly the single-device sample's token,
on awkward vocabulary and batch sizes, with padding rows past the vocabulary, ties and non-finite rows.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (small sizes there).
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.parallel_state import vocab_range
from graphrunner.sampling import sample_ref
from graphrunner.sampling.vocab_parallel import (
    combine_shard_picks,
    sample_vocab_parallel,
    shard_sample_ref,
    shard_sample_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(num_reqs: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + 3
    logits = torch.randn(num_reqs, vocab, generator=g) * 3
    idx = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    temperature = torch.tensor([0.0, 0.3, 1.0, 1.7])[torch.randint(0, 4, (num_rows,), generator=g)]
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=g, dtype=torch.int64)
    num_tokens = torch.randint(0, 5000, (num_rows,), generator=g, dtype=torch.int32)
    return [t.to(DEVICE) for t in (logits, idx, temperature, seeds, num_tokens)]


def _shards(logits: torch.Tensor, world: int) -> list[tuple[torch.Tensor, int]]:
    """Each rank's logits [B, ceil(V / W)] (padding columns filled with garbage that must be ignored)."""
    vocab = logits.shape[1]
    out = []
    for rank in range(world):
        start, rows = vocab_range(vocab, rank, world)
        part = torch.full((logits.shape[0], rows), 1e9, device=logits.device)  # padding: would win if read
        real = logits[:, start:start + rows]
        part[:, :real.shape[1]] = real
        out.append((part, start))
    return out


def _sharded_sample(fn, logits, idx, temperature, seeds, num_tokens, world):  # type: ignore[no-untyped-def]
    picks = []
    for part, start in _shards(logits, world):
        best, best_id = fn(part, start, logits.shape[1], idx, temperature, seeds, num_tokens)
        valid = min(part.shape[1], logits.shape[1] - start)
        flag = (~torch.isfinite(part[:, :valid]).all(dim=-1)).float()
        picks.append(torch.stack([best, best_id.float(), flag], dim=-1))
    return combine_shard_picks(torch.stack(picks, dim=1))


@pytest.mark.parametrize("fn", [shard_sample_ref, shard_sample_triton], ids=["ref", "triton"])
@pytest.mark.parametrize(("num_reqs", "vocab", "world"), [(1, 1, 1), (3, 2, 2), (5, 509, 2), (4, 1000, 3),
                                                          (2, 4099, 2), (7, 313, 4), (0, 77, 2)])
def test_shards_combined_equal_the_single_device_sample(fn, num_reqs: int, vocab: int, world: int) -> None:  # type: ignore[no-untyped-def]
    world = min(world, vocab)  # every rank must hold at least one real id
    logits, idx, temperature, seeds, num_tokens = _batch(num_reqs, vocab, seed=vocab + num_reqs)
    token, nonfinite = _sharded_sample(fn, logits, idx, temperature, seeds, num_tokens, world)
    assert torch.equal(token, sample_ref(logits, idx, temperature, seeds, num_tokens))
    assert not nonfinite.any()


def test_triton_matches_reference_per_shard() -> None:
    logits, idx, temperature, seeds, num_tokens = _batch(6, 1500, seed=3)
    for part, start in _shards(logits, 3):
        ref = shard_sample_ref(part, start, 1500, idx, temperature, seeds, num_tokens)
        tri = shard_sample_triton(part, start, 1500, idx, temperature, seeds, num_tokens)
        assert torch.equal(ref[1], tri[1])
        torch.testing.assert_close(ref[0], tri[0])


def test_ties_go_to_the_lowest_id_across_shards() -> None:
    logits, idx, temperature, seeds, num_tokens = _batch(3, 10, seed=1)
    temperature.zero_()  # greedy: exact ties possible
    logits.fill_(0.0)
    logits[:, [2, 7]] = 5.0  # a tie between rank 0's id 2 and rank 1's id 7
    token, _ = _sharded_sample(shard_sample_ref, logits, idx, temperature, seeds, num_tokens, 2)
    assert token.tolist() == [2, 2, 2]
    logits[0, 2] = float("nan")
    _, nonfinite = _sharded_sample(shard_sample_ref, logits, idx, temperature, seeds, num_tokens, 2)
    assert nonfinite.tolist() == [True, False, False]


def test_one_rank_needs_no_group() -> None:
    logits, idx, temperature, seeds, num_tokens = _batch(4, 600, seed=5)
    token, nonfinite = sample_vocab_parallel(logits, 0, 600, idx, temperature, seeds, num_tokens, use_triton=False)
    assert torch.equal(token, sample_ref(logits, idx, temperature, seeds, num_tokens)) and not nonfinite.any()


def test_bad_shards_are_refused() -> None:
    logits, idx, temperature, seeds, num_tokens = _batch(2, 10, seed=0)
    with pytest.raises(ValueError, match="vocab_start 10 is not inside the vocabulary"):
        shard_sample_ref(logits, 10, 10, idx, temperature, seeds, num_tokens)
    with pytest.raises(ValueError, match="idx_mapping has 1 entries"):
        shard_sample_triton(logits, 0, 10, idx[:1], temperature, seeds, num_tokens)
