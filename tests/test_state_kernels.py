"""Tests for graphrunner.state_kernels: ragged row writes and the post-sample update, Triton vs reference vs loop.

Runs on CUDA when available, else on CPU with Triton in interpreter mode (set by conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.input_prep import prepare_inputs
from graphrunner.state_kernels import apply_ragged_writes, post_update

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _i32(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


# ------------------------------------------------------------------------------------------------ ragged writes

# (R, L, [(row, start, length), ...]); rows may repeat with disjoint column ranges.
RAGGED_CASES = {
    "empty": (4, 10, []),
    "one_value": (3, 7, [(2, 6, 1)]),
    "zero_length_write": (3, 9, [(0, 4, 0), (1, 0, 9)]),
    "mixed": (11, 700, [(5, 0, 300), (0, 17, 257), (9, 699, 1), (5, 300, 3), (3, 100, 513), (10, 0, 0)]),
}


@pytest.mark.parametrize("case", list(RAGGED_CASES))
@pytest.mark.parametrize("use_triton", [False, True])
def test_apply_ragged_writes_matches_loop(case: str, use_triton: bool) -> None:
    num_rows, max_len, writes = RAGGED_CASES[case]
    g = torch.Generator().manual_seed(len(writes))
    dst = torch.randint(-5, 5, (num_rows, max_len), generator=g, dtype=torch.int32)
    lens = [n for _, _, n in writes]
    values = torch.randint(100, 10_000, (sum(lens),), generator=g, dtype=torch.int32)
    expected = dst.tolist()
    off = 0
    for row, start, n in writes:
        for i in range(n):
            expected[row][start + i] = int(values[off + i])
        off += n
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = dst.to(DEVICE)
    apply_ragged_writes(out, _i32([w[0] for w in writes]), _i32([w[1] for w in writes]), _i32(cu), values.to(DEVICE),
                        use_triton=use_triton)
    assert out.cpu().tolist() == expected


def test_apply_ragged_writes_other_dtype_and_strided_dst() -> None:
    """dst can be any dtype matching values and a column slice of a wider buffer."""
    for use_triton in (False, True):
        wide = torch.zeros(3, 12, dtype=torch.int64, device=DEVICE)
        dst = wide[:, 2:9]
        apply_ragged_writes(dst, _i32([2, 0]), _i32([1, 5]), _i32([0, 3, 5]),
                            torch.tensor([7, 8, 9, 1, 2], dtype=torch.int64, device=DEVICE), use_triton=use_triton)
        expected = torch.zeros(3, 12, dtype=torch.int64)
        expected[2, 3:6] = torch.tensor([7, 8, 9])
        expected[0, 7:9] = torch.tensor([1, 2])
        assert torch.equal(wide.cpu(), expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"values": torch.zeros(2, dtype=torch.int64)}, "values must be torch.int32"),
        ({"rows": torch.zeros(2, dtype=torch.int32)}, "starts has 1 entries, rows has 2"),
        ({"cu_lens": torch.zeros(3, dtype=torch.int32)}, "cu_lens must have"),
        ({"starts": torch.zeros(1, dtype=torch.int64)}, "starts must be torch.int32"),
        ({"dst": torch.zeros(8, dtype=torch.int32)}, "dst must be 2-D"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_apply_ragged_writes_validation(kwargs: dict, match: str, use_triton: bool) -> None:
    args = {"dst": torch.zeros(2, 8, dtype=torch.int32), "rows": torch.zeros(1, dtype=torch.int32),
            "starts": torch.zeros(1, dtype=torch.int32), "cu_lens": torch.tensor([0, 2], dtype=torch.int32),
            "values": torch.ones(2, dtype=torch.int32)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        apply_ragged_writes(**{k: v.to(DEVICE) for k, v in args.items()}, use_triton=use_triton)


# ------------------------------------------------------------------------------------------------ post_update


def _post_update_loop(idx, nsched, sampled, token_ids, num_computed, num_tokens) -> None:
    max_len = len(token_ids[0]) if token_ids else 0
    for b, row in enumerate(idx):
        nc = num_computed[row] + nsched[b]
        num_computed[row] = nc
        if nc >= num_tokens[row] and num_tokens[row] < max_len:
            token_ids[row][num_tokens[row]] = sampled[b]
            num_tokens[row] += 1


# (R, L, [(row, num_computed, num_tokens, num_scheduled), ...])
POST_CASES = {
    "empty": (3, 8, []),
    "one_decode": (1, 9, [(0, 4, 5, 1)]),
    "mixed": (
        9,
        37,
        [
            (7, 10, 11, 1),  # decode: appends at 11
            (0, 0, 30, 16),  # partial prefill chunk: history untouched
            (3, 16, 30, 14),  # last prefill chunk: appends at 30
            (5, 36, 37, 1),  # row full (num_tokens == L): no append
            (2, 35, 36, 1),  # appends into the last column
            (8, 0, 1, 1),  # one-token prompt
        ],
    ),
}


@pytest.mark.parametrize("case", list(POST_CASES))
@pytest.mark.parametrize("use_triton", [False, True])
def test_post_update_matches_loop(case: str, use_triton: bool) -> None:
    num_rows, max_len, reqs = POST_CASES[case]
    g = torch.Generator().manual_seed(num_rows)
    token_ids = torch.randint(0, 1000, (num_rows, max_len), generator=g, dtype=torch.int32)
    num_computed = torch.randint(0, 3, (num_rows,), generator=g, dtype=torch.int32)
    num_tokens = torch.randint(3, 6, (num_rows,), generator=g, dtype=torch.int32)
    for row, nc, nt, _ in reqs:
        num_computed[row], num_tokens[row] = nc, nt
    idx = [r[0] for r in reqs]
    nsched = [r[3] for r in reqs]
    sampled = [5000 + i for i in range(len(reqs))]
    exp_tok, exp_nc, exp_nt = token_ids.tolist(), num_computed.tolist(), num_tokens.tolist()
    _post_update_loop(idx, nsched, sampled, exp_tok, exp_nc, exp_nt)
    tok_d, nc_d, nt_d = token_ids.to(DEVICE), num_computed.to(DEVICE), num_tokens.to(DEVICE)
    post_update(_i32(idx), _i32(nsched), _i32(sampled), tok_d, nc_d, nt_d, use_triton=use_triton)
    assert tok_d.cpu().tolist() == exp_tok
    assert nc_d.cpu().tolist() == exp_nc
    assert nt_d.cpu().tolist() == exp_nt


@pytest.mark.parametrize(
    "pos, bad, match",
    [
        (0, torch.zeros(2, dtype=torch.int64), "idx_mapping must be torch.int32"),
        (1, torch.zeros(3, dtype=torch.int32), "must have the same length"),
        (2, torch.zeros(2, dtype=torch.int64), "sampled must be torch.int32"),
        (3, torch.zeros(4, dtype=torch.int32), "token_ids must be 2-D"),
        (4, torch.zeros(5, dtype=torch.int32), "row counts differ"),
        (5, torch.zeros(4, dtype=torch.float32), "num_tokens must be torch.int32"),
    ],
)
@pytest.mark.parametrize("use_triton", [False, True])
def test_post_update_validation(pos: int, bad: torch.Tensor, match: str, use_triton: bool) -> None:
    args = [torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            torch.zeros(4, 6, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)]
    args[pos] = bad
    with pytest.raises(ValueError, match=match):
        post_update(*(a.to(DEVICE) for a in args), use_triton=use_triton)


@pytest.mark.parametrize("use_triton", [False, True])
def test_steps_chunked_prefill_then_decode(use_triton: bool) -> None:
    """A few steps of writes -> prepare -> post_update: prefill in two chunks, then decodes, history grows."""
    bs, max_len = 16, 64
    token_ids = torch.zeros(3, max_len, dtype=torch.int32, device=DEVICE)
    block_table = torch.arange(12, dtype=torch.int32, device=DEVICE).view(3, 4).flip(1).contiguous()
    num_computed = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    num_tokens = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    prompt = list(range(100, 140))  # 40 tokens into row 1
    apply_ragged_writes(token_ids, _i32([1]), _i32([0]), _i32([0, 40]), _i32(prompt), use_triton=use_triton)
    num_tokens[1] = 40
    history = list(prompt)
    for step, n in enumerate([25, 15, 1, 1, 1]):
        inp = prepare_inputs(_i32([1]), _i32([n]), token_ids, num_computed, block_table, bs, n + 2, 4,
                             use_triton=use_triton)
        nc = int(num_computed[1])
        assert inp.input_ids[:n].tolist() == history[nc : nc + n]
        assert inp.positions[:n].tolist() == list(range(nc, nc + n))
        assert inp.slot_mapping[n:].tolist() == [-1, -1]
        assert inp.slot_mapping[:n].tolist() == [int(block_table[1, p // bs]) * bs + p % bs for p in range(nc, nc + n)]
        post_update(_i32([1]), _i32([n]), _i32([7000 + step]), token_ids, num_computed, num_tokens,
                    use_triton=use_triton)
        if nc + n >= len(history):
            history.append(7000 + step)
        assert int(num_computed[1]) == nc + n
        assert token_ids[1, : len(history)].tolist() == history
        assert int(num_tokens[1]) == len(history)
    assert history[40:] == [7001, 7002, 7003, 7004]
