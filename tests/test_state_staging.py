"""The state table's staged writes in one Triton launch (graphrunner.state_staging) against the PyTorch reference,
and a StateTable's apply_staged on either path against what was staged: ragged token / block writes and new rows'
fields (float bits, int64 seeds of both signs and all 63 bits) on awkward sizes: nothing staged, only blocks,
one new row, more new rows than one program iteration holds, rows re-initialised in a later step.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (set by conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from graphrunner.sampling_params import SamplingParams
from graphrunner.state_staging import ROW_WIDTH, RaggedSection, RowFieldTables, apply_staged, pack_new_row
from graphrunner.state_table import StateTable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tables(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, RowFieldTables]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(-9, 9, (rows, 300), generator=g, dtype=torch.int32).to(DEVICE)
    blocks = torch.randint(-9, 9, (rows, 21), generator=g, dtype=torch.int32).to(DEVICE)
    ints = tuple(torch.randint(-9, 9, (rows,), generator=g, dtype=torch.int32).to(DEVICE) for _ in range(5))
    floats = torch.randn(6, rows, generator=g).to(DEVICE)
    seeds = torch.randint(-2**62, 2**62, (rows,), generator=g, dtype=torch.int64).to(DEVICE)
    return tokens, blocks, RowFieldTables(ints, floats, seeds)


def _ragged(dst: torch.Tensor, writes: list[tuple[int, int, list[int]]]) -> RaggedSection:
    def i32(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    cu = [0]
    for _, _, vals in writes:
        cu.append(cu[-1] + len(vals))
    return RaggedSection(dst, i32([w[0] for w in writes]), i32([w[1] for w in writes]), i32(cu),
                         i32([v for w in writes for v in w[2]]))


@pytest.mark.parametrize(("num_rows", "num_tok", "num_blk", "num_new"), [
    (5, 0, 0, 0),      # nothing staged
    (5, 0, 3, 0),      # only new blocks (a decode step that crossed a block boundary)
    (7, 1, 1, 1),      # one new request
    (150, 3, 40, 70),  # more new rows than one iteration of the fields program (64)
    (130, 129, 129, 129),
])
def test_one_launch_matches_the_reference(num_rows: int, num_tok: int, num_blk: int, num_new: int) -> None:
    rng = random.Random(num_rows * 1000 + num_new)
    rows = rng.sample(range(num_rows), k=max(num_tok, num_blk, num_new))
    tok_writes = [(r, rng.randrange(50), [rng.randrange(1 << 31) for _ in range(rng.randrange(1, 250))])
                  for r in rows[:num_tok]]
    blk_writes = [(r, rng.randrange(5), [rng.randrange(10_000) for _ in range(rng.randrange(1, 16))])
                  for r in rows[:num_blk]]
    packed: list[int] = []
    for r in rows[:num_new]:
        floats = (rng.uniform(0, 2), rng.random(), 1e-30, rng.uniform(0.5, 2), -rng.random(), float("inf"))
        seed = rng.choice([0, 1, -1, 2**63 - 1, -2**63, rng.getrandbits(63), -rng.getrandbits(40)])
        packed += pack_new_row(r, tuple(rng.randrange(-2**31, 2**31) for _ in range(5)), floats, seed)
    new_rows = torch.tensor(packed, dtype=torch.int32, device=DEVICE).view(num_new, ROW_WIDTH)
    results = []
    for use_triton in (False, True):
        tokens, blocks, fields = _tables(num_rows, seed=3)
        apply_staged(_ragged(tokens, tok_writes), _ragged(blocks, blk_writes), new_rows, fields, use_triton)
        results.append([tokens, blocks, *fields.ints, fields.floats, fields.seeds])
    for ref, got in zip(*results):
        assert torch.equal(ref, got)
    # and the reference wrote what was packed
    ref = results[0]
    for r, start, vals in tok_writes:
        assert ref[0][r, start:start + len(vals)].tolist() == vals


@pytest.mark.parametrize("use_triton", [False, True])
def test_state_table_applies_what_was_staged(use_triton: bool) -> None:
    rng = random.Random(5)
    table = StateTable(max_reqs=70, max_model_len=90, max_blocks_per_req=7, device=DEVICE, use_triton=use_triton)
    expected: dict[int, tuple[list[int], SamplingParams, int, int]] = {}
    for step in range(4):  # later steps re-initialise some rows (a preempted request re-admitted)
        for row in rng.sample(range(70), k=(1, 66, 3, 17)[step]):
            tokens = [rng.randrange(151_000) for _ in range(rng.randrange(1, 90))]
            params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.uniform(0.1, 1.0),
                                    top_k=rng.choice([0, -1, 5, 2**40]), min_p=rng.random() / 2)
            seed, computed = rng.getrandbits(63), rng.randrange(len(tokens))
            table.stage_new_row(row, tokens, len(tokens) - 1, computed, params, seed)
            table.stage_blocks(row, 0, [rng.randrange(1000) for _ in range(rng.randrange(1, 7))])
            expected[row] = (tokens, params, seed, computed)
        table.apply_staged()
    for row, (tokens, params, seed, computed) in expected.items():
        assert table.token_ids[row, :len(tokens)].tolist() == tokens
        assert table.num_tokens[row].item() == len(tokens) and table.prompt_len[row].item() == len(tokens) - 1
        assert table.num_computed[row].item() == computed and table.num_drafts[row].item() == 0
        assert table.top_k[row].item() == min(max(0, params.top_k), 2**31 - 1)
        assert table.seeds[row].item() == seed
        want = torch.tensor([params.temperature, params.top_p, params.min_p, 1.0, 0.0, 0.0], dtype=torch.float32)
        assert torch.equal(table.floats[:, row].cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled Triton kernels)")
def test_one_compiled_variant_whatever_the_step_stages() -> None:
    from graphrunner.state_staging import _apply_staged_kernel

    def variants() -> int:
        return sum(len(cache[0]) for cache in _apply_staged_kernel.device_caches.values())

    rng = random.Random(2)
    table = StateTable(max_reqs=40, max_model_len=64, max_blocks_per_req=4, device=DEVICE, use_triton=True)
    base = None
    for n in (1, 2, 3, 5, 8, 16, 17, 32, 33, 40):  # ==1, divisible by 16, neither
        for row in rng.sample(range(40), k=n):
            tokens = [rng.randrange(1000) for _ in range(rng.randrange(1, 64))]
            table.stage_new_row(row, tokens, len(tokens), 0, SamplingParams(), seed=row)
            table.stage_blocks(row, 0, [rng.randrange(100) for _ in range(rng.randrange(1, 4))])
        table.apply_staged()
        table.stage_blocks(rng.randrange(40), 3, [7])  # a step with only a new block
        table.apply_staged()
        torch.cuda.synchronize()
        base = variants() if base is None else base
        assert variants() == base, f"a new staged-writes variant after {n} new rows"
