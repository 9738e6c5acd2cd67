"""Per-step kernels must not meet new Triton specialisations while serving (issue 19's warm-up): views handed to
them start on 16-byte boundaries whatever the batch, and the sizes that follow the batch are not specialised on.
The CPU tests check the alignment of every view; the GPU test counts each kernel's compiled variants."""

from __future__ import annotations

import random

import pytest
import torch

import graphrunner.state_table as state_table_mod
from graphrunner.input_prep import StepBuffers, prepare_inputs
from graphrunner.sampling_params import SamplingParams
from graphrunner.state_table import StateTable


@pytest.mark.parametrize("padded", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64])
def test_step_rows_views_are_aligned_and_round_trip(padded: int) -> None:
    buffers = StepBuffers(max_reqs=64, max_tokens=128, max_block_cols=4, device=torch.device("cpu"), padding_row=99)
    b = max(1, padded - 2)
    rows = [random.Random(padded).randrange(64) for _ in range(b)]
    counts = list(range(1, b + 1))
    staged = buffers.stage_rows(rows, counts, padded)
    buffers.step_rows[:staged.shape[0]].copy_(staged)
    idx, num = buffers.rows(b, padded)
    assert idx.data_ptr() % 16 == 0 and num.data_ptr() % 16 == 0
    assert idx.tolist() == rows and num.tolist() == counts
    # the padded rows point at the padding row with 0 tokens (what a FULL graph of `padded` rows reads)
    all_idx, all_num = buffers.rows(padded, padded)
    assert all_idx.tolist() == rows + [99] * (padded - b) and all_num.tolist() == counts + [0] * (padded - b)


@pytest.mark.parametrize("padded", [1, 3, 8, 13])
def test_fill_padding_rows_matches_rows(padded: int) -> None:
    buffers = StepBuffers(max_reqs=16, max_tokens=32, max_block_cols=2, device=torch.device("cpu"), padding_row=16)
    buffers.step_rows.fill_(7)
    buffers.fill_padding_rows(padded)
    idx, num = buffers.rows(padded, padded)
    assert idx.tolist() == [16] * padded and num.tolist() == [0] * padded


def test_apply_staged_hands_aligned_views_and_writes_what_was_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    pointers: list[int] = []
    real = state_table_mod.apply_staged

    def recording(tokens, blocks, new_rows, dst, use_triton):  # type: ignore[no-untyped-def]
        for sec in (tokens, blocks):
            if sec.rows.numel():
                pointers.extend(t.data_ptr() for t in (sec.rows, sec.starts, sec.cu_lens, sec.values))
        pointers.append(new_rows.data_ptr())
        return real(tokens, blocks, new_rows, dst, use_triton)

    monkeypatch.setattr(state_table_mod, "apply_staged", recording)
    rng = random.Random(0)
    table = StateTable(max_reqs=9, max_model_len=40, max_blocks_per_req=6, device=torch.device("cpu"),
                       use_triton=False)
    expected_tokens: dict[int, list[int]] = {}
    expected_blocks: dict[int, list[int]] = {}
    for round_ in range(6):  # every section length mod 4 comes up
        for row in rng.sample(range(9), k=1 + round_ % 5):
            tokens = [rng.randrange(1000) for _ in range(rng.randrange(1, 23))]
            blocks = [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
            table.stage_new_row(row, tokens, len(tokens), 0, SamplingParams(), seed=row)
            table.stage_blocks(row, 0, blocks)
            expected_tokens[row], expected_blocks[row] = tokens, blocks
        table.apply_staged()
    assert pointers and all(p % 16 == 0 for p in pointers)
    for row, tokens in expected_tokens.items():
        assert table.token_ids[row, :len(tokens)].tolist() == tokens
        assert table.num_tokens[row].item() == len(tokens)
        assert table.block_table[row, :len(expected_blocks[row])].tolist() == expected_blocks[row]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled Triton kernels)")
def test_prepare_and_sample_compile_one_variant_for_every_batch() -> None:
    from graphrunner.input_prep import _prepare_inputs_kernel
    from graphrunner.sampling.gumbel_split import _split_sample_partial_kernel, sample_split_triton

    dev = torch.device("cuda")
    rng = random.Random(1)
    max_reqs, max_len, block_size, cols = 40, 256, 16, 16
    buffers = StepBuffers(max_reqs, 512, cols, dev, padding_row=max_reqs)
    token_ids = torch.randint(0, 1000, (max_reqs + 1, max_len), dtype=torch.int32, device=dev)
    num_computed = torch.zeros(max_reqs + 1, dtype=torch.int32, device=dev)
    block_table = torch.arange((max_reqs + 1) * cols, dtype=torch.int32, device=dev).view(max_reqs + 1, cols)
    logits = torch.randn(max_reqs, 15000, device=dev)  # 1 to 15 chunks a row as the batch grows: one C_PAD
    temperature = torch.rand(max_reqs + 1, device=dev)
    seeds = torch.arange(max_reqs + 1, dtype=torch.int64, device=dev)
    num_tokens_state = torch.full((max_reqs + 1,), 5, dtype=torch.int32, device=dev)

    def variants(kernel) -> int:  # type: ignore[no-untyped-def]
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    base: tuple[int, int] | None = None
    for b in (1, 2, 3, 5, 8, 16, 17, 32, 33, 40):  # ==1, divisible by 16, neither; aligned and not
        counts = [rng.randrange(1, 9) for _ in range(b)]
        rows = rng.sample(range(max_reqs), k=b)
        staged = buffers.stage_rows(rows, counts, b).to(dev)
        buffers.step_rows[:staged.shape[0]].copy_(staged)
        idx, num = buffers.rows(b, b)
        n_tok = sum(counts)
        prepare_inputs(idx, num, token_ids, num_computed, block_table, block_size, n_tok, cols, True,
                       out=buffers.views(b, n_tok, cols))
        sample_split_triton(logits[:b], idx, temperature, seeds, num_tokens_state)
        torch.cuda.synchronize()
        # counted from the first batch on: tests run earlier in this process may have compiled other variants
        now = (variants(_prepare_inputs_kernel), variants(_split_sample_partial_kernel))
        base = base or now
        assert now[0] == base[0], f"a new prepare_inputs variant at batch {b}"
        assert now[1] == base[1], f"a new split-sampler variant at batch {b}"


@pytest.mark.gpu
def test_verify_kernels_compile_one_variant_for_every_draft_width() -> None:
    """The verify step's kernels meet a new K (the most drafts any request of the step holds: 1 .. k) and batch
    size from step to step; strides of K and K + 1 must not be specialised on (K = 1, K + 1 = 16)."""
    from graphrunner.sampling.rejection_split import (
        _rejection_partial_kernel,
        _rejection_walk_kernel,
        rejection_sample_split_triton,
    )
    from graphrunner.spec_decode.update import (
        _post_update_spec_kernel,
        _read_drafts_kernel,
        post_update_spec,
        read_drafts,
    )

    dev = torch.device("cuda")
    rows_total, max_len, vocab = 20, 96, 3000
    token_ids = torch.randint(0, vocab, (rows_total, max_len), dtype=torch.int32, device=dev)
    num_tokens = torch.full((rows_total,), 40, dtype=torch.int32, device=dev)
    num_computed = num_tokens - 1
    row_drafts = torch.full((rows_total,), 16, dtype=torch.int32, device=dev)
    kernels = (_rejection_partial_kernel, _rejection_walk_kernel, _post_update_spec_kernel, _read_drafts_kernel)

    def variants() -> list[int]:
        return [sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels]

    base: list[int] | None = None
    for b, width in ((1, 4), (3, 1), (2, 15), (5, 16), (16, 7), (4, 1), (1, 15)):
        idx = torch.arange(b, dtype=torch.int32, device=dev)  # [B] int32
        num_spec = torch.full((b,), width, dtype=torch.int32, device=dev)  # [B] int32
        drafts, num_drafts = read_drafts(idx, num_spec, width, token_ids, num_tokens, row_drafts, True)
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev) * (width + 1)  # [B + 1] int32
        logits = torch.randn(b * (width + 1), vocab, device=dev)
        out, acc = rejection_sample_split_triton(logits, cu, drafts, num_drafts, torch.zeros(b, device=dev),
                                                 torch.zeros(b, dtype=torch.int64, device=dev),
                                                 num_tokens[:b].long())
        post_update_spec(idx, num_spec + 1, num_spec, out, acc, token_ids, num_computed, num_tokens, None, True)
        num_computed.copy_(num_tokens - 1)
        torch.cuda.synchronize()
        now = variants()
        base = base or now  # counted from the first step on (earlier tests may have compiled other variants)
        assert now == base, f"new variants {now} (first {base}) at batch {b}, K = {width}"
