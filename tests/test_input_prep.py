"""Tests for graphrunner.input_prep: the Triton kernel and the PyTorch reference against a plain Python loop.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (set by conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.input_prep import StepInputs, prepare_inputs, prepare_inputs_ref, prepare_inputs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping", "block_table", "logits_indices")
DTYPES = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "query_start_loc": torch.int32,
    "seq_lens": torch.int32,
    "slot_mapping": torch.int64,
    "block_table": torch.int32,
    "logits_indices": torch.int64,
}


def _state(num_rows: int, max_len: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max_len // block_size)
    token_ids = torch.randint(0, 50_000, (num_rows, max_len), generator=g, dtype=torch.int32)  # [R, L] int32
    block_table = torch.randperm(num_rows * max_blocks + 7, generator=g)[: num_rows * max_blocks]
    block_table = block_table.view(num_rows, max_blocks).to(torch.int32)  # [R, M] int32
    return token_ids, block_table


def _loop_oracle(idx, nsched, token_ids, num_computed, block_table, block_size, num_tokens, num_block_cols) -> dict:
    """Obviously-correct Python loop over requests and tokens."""
    ids, pos, slots = [0] * num_tokens, [0] * num_tokens, [-1] * num_tokens
    qsl, seq_lens, logits_idx, bt = [0], [], [], []
    t = 0
    for row, n in zip(idx, nsched):
        nc = num_computed[row]
        for i in range(n):
            p = nc + i
            ids[t] = token_ids[row][p]
            pos[t] = p
            slots[t] = block_table[row][p // block_size] * block_size + p % block_size
            t += 1
        qsl.append(t)
        seq_lens.append(nc + n)
        logits_idx.append(t - 1)
        bt.append(block_table[row][:num_block_cols])
    return {
        "input_ids": ids,
        "positions": pos,
        "query_start_loc": qsl,
        "seq_lens": seq_lens,
        "slot_mapping": slots,
        "block_table": bt,
        "logits_indices": logits_idx,
    }


def _assert_matches(out: StepInputs, expected: dict, num_reqs: int, num_block_cols: int) -> None:
    for f in FIELDS:
        got = getattr(out, f)
        assert got.dtype == DTYPES[f], f
        assert got.device.type == DEVICE, f
        if f == "block_table":
            assert got.shape == (num_reqs, num_block_cols)
            assert got.cpu().tolist() == [list(r) for r in expected[f]], f
        else:
            assert got.cpu().tolist() == expected[f], f


# (num_rows, max_len, [(row, num_computed, num_scheduled), ...], padding tokens, num_block_cols or None = all)
CASES = {
    "empty": (3, 40, [], 0, None),
    "empty_with_padding": (3, 40, [], 5, 2),
    "one_decode": (1, 33, [(0, 20, 1)], 0, None),
    "mixed_with_padding": (9, 200, [(4, 0, 70), (1, 37, 1), (7, 13, 45), (0, 199, 1), (8, 5, 3)], 11, None),
    "long_prefill_chunks": (5, 700, [(3, 17, 333), (0, 0, 129), (2, 400, 1)], 3, 9),
    "zero_block_cols": (4, 50, [(2, 3, 4)], 1, 0),
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("use_triton", [False, True])
def test_prepare_inputs_matches_loop(case: str, block_size: int, use_triton: bool) -> None:
    num_rows, max_len, reqs, pad, cols = CASES[case]
    token_ids, block_table = _state(num_rows, max_len, block_size, seed=len(reqs) * 31 + block_size)
    num_computed = torch.randint(0, 5, (num_rows,), dtype=torch.int32)
    for row, nc, _ in reqs:
        num_computed[row] = nc
    idx = [r for r, _, _ in reqs]
    nsched = [n for _, _, n in reqs]
    num_tokens = sum(nsched) + pad
    num_block_cols = block_table.shape[1] if cols is None else cols
    expected = _loop_oracle(idx, nsched, token_ids.tolist(), num_computed.tolist(), block_table.tolist(), block_size,
                            num_tokens, num_block_cols)
    out = prepare_inputs(
        torch.tensor(idx, dtype=torch.int32, device=DEVICE), torch.tensor(nsched, dtype=torch.int32, device=DEVICE),
        token_ids.to(DEVICE), num_computed.to(DEVICE), block_table.to(DEVICE), block_size, num_tokens, num_block_cols,
        use_triton=use_triton,
    )
    _assert_matches(out, expected, len(reqs), num_block_cols)


@pytest.mark.parametrize("block_size", [16, 32])
def test_ref_vs_triton_random(block_size: int) -> None:
    """Many requests (more than one kernel block of them), random chunk lengths, unsorted rows, padding."""
    g = torch.Generator().manual_seed(block_size)
    num_rows, max_len, num_reqs = 173, 97, 141
    token_ids, block_table = _state(num_rows, max_len, block_size, seed=5)
    rows = torch.randperm(num_rows, generator=g)[:num_reqs].to(torch.int32)
    nsched = torch.where(torch.rand(num_reqs, generator=g) < 0.8, 1, torch.randint(1, 40, (num_reqs,), generator=g))
    nsched = nsched.to(torch.int32)
    num_computed = torch.randint(0, max_len - 40, (num_rows,), generator=g, dtype=torch.int32)
    num_tokens = int(nsched.sum()) + 13
    args = [t.to(DEVICE) for t in (rows, nsched, token_ids, num_computed, block_table)]
    a = prepare_inputs_ref(*args, block_size, num_tokens, 3)
    b = prepare_inputs_triton(*args, block_size, num_tokens, 3)
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    expected = _loop_oracle(rows.tolist(), nsched.tolist(), token_ids.tolist(), num_computed.tolist(),
                            block_table.tolist(), block_size, num_tokens, 3)
    _assert_matches(b, expected, num_reqs, 3)


def test_noncontiguous_persistent_tables() -> None:
    """Row strides of the persistent tables are honoured (tables sliced out of wider buffers)."""
    token_ids, block_table = _state(6, 80, 16, seed=3)
    wide_tokens = torch.zeros(6, 100, dtype=torch.int32)
    wide_tokens[:, :80] = token_ids
    wide_bt = torch.zeros(6, 9, dtype=torch.int32)
    wide_bt[:, :5] = block_table
    args = (torch.tensor([5, 2], dtype=torch.int32), torch.tensor([30, 1], dtype=torch.int32))
    num_computed = torch.tensor([0, 0, 60, 0, 0, 10], dtype=torch.int32)
    for use_triton in (False, True):
        out = prepare_inputs(*(t.to(DEVICE) for t in args), wide_tokens[:, :80].to(DEVICE), num_computed.to(DEVICE),
                             wide_bt[:, :5].to(DEVICE), 16, 33, 4, use_triton=use_triton)
        expected = _loop_oracle([5, 2], [30, 1], token_ids.tolist(), num_computed.tolist(), block_table.tolist(), 16,
                                33, 4)
        _assert_matches(out, expected, 2, 4)


def _valid_args() -> list:
    token_ids, block_table = _state(4, 32, 16, seed=0)
    return [torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), token_ids,
            torch.zeros(4, dtype=torch.int32), block_table, 16, 4, 2]


@pytest.mark.parametrize(
    "pos, bad, match",
    [
        (0, torch.tensor([1], dtype=torch.int64), "idx_mapping must be torch.int32"),
        (1, torch.tensor([2, 3], dtype=torch.int32), "num_scheduled shape"),
        (2, torch.zeros(4, 32, dtype=torch.int64), "token_ids must be torch.int32"),
        (3, torch.zeros(5, dtype=torch.int32), "row counts differ"),
        (4, torch.zeros(4, dtype=torch.int32), "block_table must be 2-D"),
        (5, 0, "block_size"),
        (6, -1, "num_tokens"),
        (7, 3, "num_block_cols"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_validation(pos: int, bad, match: str, use_triton: bool) -> None:
    args = _valid_args()
    args[pos] = bad
    with pytest.raises(ValueError, match=match):
        prepare_inputs(*args, use_triton=use_triton)
