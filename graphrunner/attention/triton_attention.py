"""Triton paged attention: one launch serves a varlen batch of prefill chunks and decodes.

Each program owns (request, tile of query tokens x the query heads of one KV head, KV split):
GQA heads are packed into the tile's rows, keys/values are gathered from the paged cache through
the request's block table, and an online softmax runs over the tile's causal key range. With
num_splits > 1 each program covers one slice of that range and a reduction kernel (split_merge.py) merges the
partial results (flash-decoding). `write_kv_triton` fills the cache from slot_mapping, skipping
slot -1. The PyTorch reference for both is graphrunner.attention.reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrunner.attention.decode_prep import DecodePrep, prep_rows
from graphrunner.attention.metadata import AttentionMetadata
from graphrunner.attention.split_merge import _merge_rows, _merge_splits_kernel
from graphrunner.env import env_choice, env_number
from graphrunner.kernel_checks import check_tensor, step_sizes, zeroed_counters
from graphrunner.opaque import opaque_op
from graphrunner.pdl import pdl_enter, pdl_mode, use_pdl

# keys per inner iteration (several paged blocks, gathered per position), and the main kernel's warps (0: 8 for
# 128-row tiles, else 4). GRAPHRUNNER_ATTN_TILE / _WARPS set them for measurements: compiled for sm_90 at 4 warps
# and 64 keys the kernel spills registers, at 8 warps or 32 keys it does not (tools/kernel_resources.py).
TILE_N = int(env_number("GRAPHRUNNER_ATTN_TILE", 64, integer=True, rule="in (32, 64, 128)",
                        valid=lambda v: v in (32, 64, 128)))
ATTN_WARPS = int(env_number("GRAPHRUNNER_ATTN_WARPS", 0, integer=True, rule="in (0, 4, 8)",
                            valid=lambda v: v in (0, 4, 8)))
DECODE_ROWS = 16       # tile rows for decode-only batches (tl.dot needs >= 16)
PREFILL_ROWS = 64      # tile rows for batches with prefill chunks
# Tile rows for prefill chunks when the KV range is split (a short chunk over a long cached prefix, e.g. a prefix-
# cache hit): every query tile reads the whole range, so fewer, taller tiles read less KV. GRAPHRUNNER_ATTN_* set
# these for measurements (docs/BENCHMARKS.md).
SPLIT_PREFILL_ROWS = int(env_number("GRAPHRUNNER_ATTN_SPLIT_ROWS", 64, integer=True, rule="in (64, 128)",
                                    valid=lambda v: v in (64, 128)))
MAX_SPLITS = int(env_number("GRAPHRUNNER_ATTN_MAX_SPLITS", 16, integer=True, rule="in [1, 64]",
                            valid=lambda v: 1 <= v <= 64))
# Decode-style launches split the KV range only from this context length on, and into at most one split per
# SPLIT_MIN_KEYS keys: short-context decode at small batch is latency-bound (H200, bench_attention_splits.py,
# batch 1 at 200 keys: 7.6 us unsplit, 4.6-5.6 us in 4-6 splits; at 128 keys splitting does not pay yet; L1 TPOT
# 0.777 -> 0.730 ms with 128 instead of 256: docs/BENCHMARKS.md, fifteenth session).
SPLIT_MIN_SEQ_LEN = int(env_number("GRAPHRUNNER_ATTN_SPLIT_MIN_LEN", 128, integer=True, rule="in [1, 1048576]",
                                   valid=lambda v: 1 <= v <= 1 << 20))
SPLIT_MIN_KEYS = int(env_number("GRAPHRUNNER_ATTN_SPLIT_MIN_KEYS", 64, integer=True, rule="in [16, 65536]",
                                valid=lambda v: 16 <= v <= 65536))
# Decode-style launches split until they reach ~2 waves on a 132-SM H200 (GRAPHRUNNER_ATTN_TARGET_PROGRAMS sets it
# for measurements: at batch 8 of 8 KV heads, 264 gives 5 splits, 128 gives 2, 64 none, and no merge kernel)
_TARGET_PROGRAMS = int(env_number("GRAPHRUNNER_ATTN_TARGET_PROGRAMS", 264, integer=True, rule="in [1, 65536]",
                                  valid=lambda v: 1 <= v <= 65536))
# GRAPHRUNNER_ATTN_FOLD_MERGE=1: the last split program of each tile merges the splits itself (an atomic counter per
# tile), so a split launch needs no second kernel; off until measured on the H200 (docs/DECISIONS.md).
FOLD_MERGE = env_choice("GRAPHRUNNER_ATTN_FOLD_MERGE", ("0", "1"), "0") == "1"
# The key loop issues V and the next tile's block ids together with K (one memory latency per tile instead of three
# dependent ones); bit-equal either way; GRAPHRUNNER_ATTN_PREFETCH=0 restores the plain loop (docs/DECISIONS.md).
PREFETCH_KV = env_choice("GRAPHRUNNER_ATTN_PREFETCH", ("0", "1"), "1") == "1"
_MAX_TILES = 16384
_counters: dict[torch.device, torch.Tensor] = {}


def _counter_buffer(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The folded merge's per-tile arrival counters (kernel_checks.zeroed_counters); None where they cannot serve
    (too many tiles, or a graph capture before any exist): the plain merge kernel then runs, with the same bits."""
    return zeroed_counters(_counters, device, _MAX_TILES) if tiles <= _MAX_TILES else None


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit(do_not_specialize=step_sizes("num_tokens"))
def _unified_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr, counter_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, num_tokens, num_q_heads,
    scale, softcap, window,
    # PREP (decode_prep.py): q, k and v come from the fused projection qkv_ptr [T, (Hq + 2 Hkv) D]
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, slot_ptr, stride_qkv, stride_cos, stride_sin, eps,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr,
    FOLD_MERGE: tl.constexpr, PREFETCH: tl.constexpr, PREP: tl.constexpr, HAS_NORM: tl.constexpr,
):
    if PDL:  # everything below reads what earlier kernels wrote (graphrunner.pdl)
        pdl_enter(PDL)
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)  # issued with the query range's loads, so their latencies overlap
    if q_tile * BLOCK_Q < q_len:
        ctx = seq_len - q_len                                    # cached prefix before this chunk
        m = tl.arange(0, BLOCK_M)
        q_local = q_tile * BLOCK_Q + m // GROUP                  # query index inside the chunk
        head = kvh * GROUP + m % GROUP
        row_ok = (m < BLOCK_Q * GROUP) & (q_local < q_len)
        q_pos = ctx + q_local                                    # absolute position of each row
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        if PREP:  # decode: one token per request, its q heads normed and roped here
            q = prep_rows(qkv_ptr + q_start * stride_qkv + head[:, None] * HEAD_DIM, q_norm_ptr,
                          cos_ptr + q_start * stride_cos + tl.zeros([BLOCK_M, 1], tl.int32),
                          sin_ptr + q_start * stride_sin + tl.zeros([BLOCK_M, 1], tl.int32), row_ok[:, None], d,
                          eps, HEAD_DIM, HAS_NORM)
        else:
            q = tl.load(q_ptr + (q_start + q_local)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # Causal key range of the whole tile, then this program's slice of it.
        last_q = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
        kv_end = ctx + last_q + 1
        kv_start = 0
        if USE_WINDOW:
            kv_start = tl.maximum(ctx + q_tile * BLOCK_Q - window + 1, 0)
        per = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE) * TILE
        lo = kv_start + split * per
        hi = tl.minimum(kv_end, lo + per)

        if PREP:
            # the new token's key and value ([1, D_PAD]); the split holding its position writes them into the cache
            # and every tile takes them from here (the cache row is not read: this launch writes it)
            new_pos = seq_len - 1
            one = tl.zeros([1, 1], tl.int32)
            num_kv_heads = tl.num_programs(2) // NUM_SPLITS
            k_new = prep_rows(qkv_ptr + q_start * stride_qkv + (num_q_heads + kvh) * HEAD_DIM + one, k_norm_ptr,
                              cos_ptr + q_start * stride_cos + one, sin_ptr + q_start * stride_sin + one, one == 0, d,
                              eps, HEAD_DIM, HAS_NORM)
            v_new = tl.load(qkv_ptr + q_start * stride_qkv + (num_q_heads + num_kv_heads + kvh) * HEAD_DIM
                            + d[None, :], mask=d_ok[None, :], other=0.0)
            slot_new = tl.load(slot_ptr + q_start)
            if (lo <= new_pos) & (new_pos < hi) & (slot_new >= 0):
                dst = (slot_new // BLOCK_SIZE) * stride_kb + (slot_new % BLOCK_SIZE) * stride_ks + kvh * stride_kh
                tl.store(k_ptr + dst + d[None, :], k_new, mask=d_ok[None, :])
                dst = (slot_new // BLOCK_SIZE) * stride_vb + (slot_new % BLOCK_SIZE) * stride_vs + kvh * stride_vh
                tl.store(v_ptr + dst + d[None, :], v_new, mask=d_ok[None, :])
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        n_base = tl.arange(0, TILE)
        bt_row = block_table_ptr + req * stride_bt
        if PREFETCH:  # the first tile's block ids before the loop; each iteration fetches the next tile's
            blk_next = tl.load(bt_row + (lo + n_base) // BLOCK_SIZE, mask=lo + n_base < hi, other=0)
        for start in range(lo, hi, TILE):
            n = start + n_base
            n_ok = n < hi
            if PREFETCH:
                blk = blk_next
            else:
                blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = n % BLOCK_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            if PREP:
                fresh = (n == new_pos)[:, None]  # [TILE, 1]
                kv_mask = kv_mask & (n != new_pos)[:, None]
            # Unused slots may hold anything (NaN included): masked loads read 0 there.
            k = tl.load(k_ptr + blk[:, None].to(tl.int64) * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh
                        + d[None, :], mask=kv_mask, other=0.0)
            if PREP:
                k = tl.where(fresh, k_new, k)
            if PREFETCH:
                # V and the next tile's block ids are issued with K, so one memory latency per tile, not three
                # (block ids -> K -> V); the arithmetic below is unchanged, so the bits are too
                v = tl.load(v_ptr + blk[:, None].to(tl.int64) * stride_vb + slot[:, None] * stride_vs
                            + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
                blk_next = tl.load(bt_row + (n + TILE) // BLOCK_SIZE, mask=n + TILE < hi, other=0)
            if FP32_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            if USE_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            keep = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            if USE_WINDOW:
                keep = keep & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: avoid -inf - -inf
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if not PREFETCH:
                v = tl.load(v_ptr + blk[:, None].to(tl.int64) * stride_vb + slot[:, None] * stride_vs
                            + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if PREP:
                v = tl.where(fresh, v_new, v)
            if FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        tok = q_start + q_local
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            # workspace: acc [S, T, Hq, D_PAD], (m, l) [S, T, Hq, 2]
            row = (split * num_tokens + tok) * num_q_heads + head
            if lo < hi:  # an empty slice's acc is zeros the merge never reads (its m is -inf): no store
                tl.store(part_acc_ptr + row[:, None].to(tl.int64) * D_PAD + d[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + row.to(tl.int64) * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + row.to(tl.int64) * 2 + 1, l_i, mask=row_ok)
            if FOLD_MERGE:  # the last of this tile's splits to finish merges them all: no merge launch
                tl.debug_barrier()  # every thread's partials are stored before the release below publishes them
                tile = (req * tl.num_programs(1) + q_tile) * (tl.num_programs(2) // NUM_SPLITS) + kvh
                done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if done == NUM_SPLITS - 1:
                    _merge_rows(part_acc_ptr, part_ml_ptr, out_ptr, tok, head, row_ok, d, d_ok, stride_ot,
                                stride_oh, num_tokens, num_q_heads, BLOCK_M, D_PAD, NUM_SPLITS)
                    tl.atomic_xchg(counter_ptr + tile, 0)  # zero again for the next launch (and graph replay)


def query_tiles(max_query_len: int, group: int) -> int:
    """Query tiles per request in the kernel's grid without KV splits (see _launch): 1 for decodes. A split
    launch may use taller tiles (SPLIT_PREFILL_ROWS); the split choice counts these."""
    rows = DECODE_ROWS if max_query_len <= 1 else PREFILL_ROWS
    return triton.cdiv(max(max_query_len, 1), max(rows, triton.next_power_of_2(group)) // group)


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """KV splits: enough programs for ~2 waves (_TARGET_PROGRAMS), at most MAX_SPLITS and one per SPLIT_MIN_KEYS
    keys, and only when max_seq_len >= SPLIT_MIN_SEQ_LEN. `num_reqs` counts (request, query tile) pairs: a short
    prefill chunk over a long cached prefix splits like a decode.

    Depends on host-known sizes only, so a captured shape keeps one grid; the span each split covers
    is computed on the device from each request's own length.
    """
    programs = max(1, num_reqs * num_kv_heads)
    if max_seq_len < SPLIT_MIN_SEQ_LEN or programs >= _TARGET_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, -(-_TARGET_PROGRAMS // programs), -(-max_seq_len // SPLIT_MIN_KEYS)))


def unified_attention(query: torch.Tensor, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      sliding_window: int | None = None, softcap: float | None = None,
                      num_splits: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D], layer_cache [2, num_blocks, block_size, Hkv, D] -> [T, Hq, D] (query's dtype).

    With `out` ([T, Hq, D], unit stride in D) the result is written there (no allocation); otherwise
    the result is allocated (traced: the opaque torch op `graphrunner::unified_attention`)."""
    window, cap = -1 if sliding_window is None else sliding_window, 0.0 if softcap is None else softcap
    if out is None:
        op = torch.ops.graphrunner.unified_attention if torch.compiler.is_compiling() else _unified_attention
        return op(query, layer_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs,
                  meta.max_query_len, scale, window, cap, num_splits)
    _launch(query, layer_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs,
            meta.max_query_len, scale, window, cap, num_splits, out)
    return out


def _unified_attention(query: torch.Tensor, layer_cache: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, block_table: torch.Tensor, num_reqs: int, max_query_len: int,
                       scale: float, sliding_window: int, softcap: float, num_splits: int) -> torch.Tensor:
    """The kernel into a new tensor (sliding_window -1 / softcap 0 = off); traced, the opaque op below, where
    torch.compile splits graphs."""
    out = torch.empty_like(query)
    _launch(query, layer_cache, query_start_loc, seq_lens, block_table, num_reqs, max_query_len, scale,
            sliding_window, softcap, num_splits, out)
    return out


def unified_attention_prepped(prep: DecodePrep, layer_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                              sliding_window: int | None, num_splits: int, out: torch.Tensor) -> None:
    """Decode attention from the un-normed, un-roped projection (decode_prep.py): out [T, Hq, D] (unit stride in
    D) <- attention of prep's queries, normed and roped in the kernel, whose keys and values the kernel also writes
    into layer_cache at prep.slot_mapping. Decode-only steps (one token per request) only."""
    if meta.max_query_len > 1:
        raise ValueError(f"the folded prologue serves decode steps (one token per request), got max_query_len "
                         f"{meta.max_query_len}")
    t, hq, dim = out.shape
    prep.check(t, hq, layer_cache.shape[3], dim)
    check_tensor(prep.qkv, "qkv", out.dtype, 2, out.device)
    window = -1 if sliding_window is None else sliding_window
    _launch(out, layer_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs,
            meta.max_query_len, scale, window, 0.0, num_splits, out, prep)


def _launch(query: torch.Tensor, layer_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_table: torch.Tensor, num_reqs: int, max_query_len: int, scale: float, sliding_window: int,
            softcap: float, num_splits: int, out: torch.Tensor, prep: DecodePrep | None = None) -> None:
    """The kernel (and the split merge) over query [T, Hq, D]; with `prep`, query only gives the shapes (out may
    stand in for it) and the queries, keys and values come from prep.qkv."""
    check_tensor(query, "query", (torch.float32, torch.bfloat16, torch.float16), 3, None)
    check_tensor(layer_cache, "layer_cache", query.dtype, 5, query.device)
    t, hq, dim = query.shape
    _, _, block_size, hkv, cache_dim = layer_cache.shape
    if cache_dim != dim or hq % hkv:
        raise ValueError(f"query [T, {hq}, {dim}] does not fit a cache with {hkv} KV heads of dim {cache_dim}")
    if query.stride(-1) != 1 or layer_cache.stride(-1) != 1:
        raise ValueError("query and layer_cache need a contiguous last (head_dim) dimension")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if block_size < 16 and TILE_N % block_size:
        raise ValueError(f"block_size {block_size} must divide {TILE_N}")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match query {tuple(query.shape)} {query.dtype}")
    if t == 0 or num_reqs == 0:
        return
    group = hq // hkv
    rows = DECODE_ROWS if max_query_len <= 1 else SPLIT_PREFILL_ROWS if num_splits > 1 else PREFILL_ROWS
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = block_m // group  # query_tiles() follows this choice
    d_pad = max(16, triton.next_power_of_2(dim))
    k_cache, v_cache = layer_cache[0], layer_cache[1]
    if num_splits > 1:
        part_acc = torch.empty(num_splits * t * hq * d_pad, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_splits * t * hq * 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (num_reqs, triton.cdiv(max(max_query_len, 1), block_q), hkv * num_splits)
    pdl = use_pdl(query.device)
    counters = _counter_buffer(query.device, grid[0] * grid[1] * hkv) if FOLD_MERGE and num_splits > 1 else None
    # a 128-row fp32 accumulator is spread over 8 warps; 64 rows keep 4, as before (ATTN_WARPS overrides)
    warps = ATTN_WARPS or (8 if block_m >= 128 else 4)
    _unified_attention_kernel[grid](
        query, k_cache, v_cache, out, part_acc, part_ml, query_start_loc, seq_lens, block_table,
        counters if counters is not None else seq_lens,  # (unused without the folded merge)
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), t, hq, scale, softcap if softcap > 0 else 1.0, max(sliding_window, 0),
        *_prep_args(prep, query),
        GROUP=group, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE=max(TILE_N, block_size), NUM_SPLITS=num_splits, USE_WINDOW=sliding_window >= 0,
        USE_SOFTCAP=softcap > 0, FP32_DOT=query.dtype == torch.float32, PDL=pdl_mode(pdl, "attention", t),
        FOLD_MERGE=counters is not None, PREFETCH=PREFETCH_KV, PREP=prep is not None,
        HAS_NORM=prep is not None and prep.q_norm is not None, num_warps=warps, launch_pdl=pdl,
    )
    if num_splits > 1 and counters is None:
        _merge_splits_kernel[(t, hq)](part_acc, part_ml, out, out.stride(0), out.stride(1), t, hq,
                                      HEAD_DIM=dim, D_PAD=d_pad, NUM_SPLITS=num_splits, PDL=pdl_mode(pdl, "merge", t),
                                      launch_pdl=pdl)


def _prep_args(prep: DecodePrep | None, query: torch.Tensor) -> tuple:
    """The kernel's qkv, q_norm, k_norm, cos, sin, slots, their strides and eps (query stands in for the unused)."""
    if prep is None:
        return (query,) * 6 + (0, 0, 0, 0.0)
    norms = (prep.q_norm, prep.k_norm) if prep.q_norm is not None else (query, query)
    return (prep.qkv, *norms, prep.cos, prep.sin, prep.slot_mapping, prep.qkv.stride(0), prep.cos.stride(0),
            prep.sin.stride(0), prep.eps)


@opaque_op("unified_attention", _unified_attention).register_fake
def _(query: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(query)


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D_PAD)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> their slots of layer_cache [2, num_blocks, block_size, Hkv, D]; slot -1 skipped."""
    check_tensor(key, "key", None, 3, None)
    check_tensor(value, "value", key.dtype, 3, key.device)
    check_tensor(layer_cache, "layer_cache", None, 5, key.device)
    check_tensor(slot_mapping, "slot_mapping", torch.int64, 1, key.device)
    t, hkv, dim = key.shape
    if value.shape != key.shape or layer_cache.shape[3:] != (hkv, dim) or slot_mapping.shape[0] != t:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)}, cache {tuple(layer_cache.shape)} "
                         f"and slot_mapping {tuple(slot_mapping.shape)} do not fit together")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or layer_cache.stride(-1) != 1:
        raise ValueError("key, value and layer_cache need a contiguous last (head_dim) dimension")
    if t == 0:
        return
    kc, vc = layer_cache[0], layer_cache[1]
    _write_kv_kernel[(t,)](key, value, kc, vc, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
                           value.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), NUM_KV_HEADS=hkv,
                           HEAD_DIM=dim, H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(dim),
                           BLOCK_SIZE=layer_cache.shape[2])
