"""Triton unified paged attention and KV write against the PyTorch reference on scattered, dirty caches.

Batches use shuffled physical blocks, partially filled last blocks, stale block-table entries and garbage
(random or NaN) in every slot no request owns. A small subset runs on CPU (Triton interpreter); the full
matrix (head dims, GQA ratios, 8K contexts, dtypes, windows, softcap, splits) is marked `gpu`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch

from graphrunner.attention import triton_attention
from graphrunner.attention.metadata import AttentionMetadata
from graphrunner.attention.reference import paged_attention_ref, write_kv_ref
from graphrunner.attention.testing import contiguous_batch
from graphrunner.attention.triton_attention import choose_num_splits, unified_attention, write_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the small subset runs on the GPU too when there is one
# The Triton interpreter multiplies the raw bit patterns of bfloat16 `tl.dot` operands (triton-lang/triton#11584,
# "not supported yet"), so the CPU subset covers the half-precision path with float16; bf16 runs on the GPU.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16

# Tolerances (atol = rtol) against an fp32 reference computed from the same (rounded) inputs:
# * fp32: both sides accumulate in fp32 and differ only in summation order (blockwise online softmax, split
#   reduction) -> errors ~1e-6 relative on outputs of magnitude ~1; 1e-4 leaves room for long contexts but would
#   catch TF32 dot products (~1e-3).
# * bf16 / fp16: the output is rounded to 8 (11) mantissa bits, half an ulp at magnitude ~1 is 2^-9 (2^-12),
#   and kernels usually also round P to the input dtype before P@V; 2e-2 (5e-3) covers both with margin
#   while a wrong mask or a dropped block moves outputs by ~1e-1 or more.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}

_REF_HAS_SOFTCAP = "softcap" in inspect.signature(paged_attention_ref).parameters


@dataclass
class Batch:
    """One step: metadata, this layer's cache (step K/V already written), queries and the logical K/V."""

    meta: AttentionMetadata
    cache: torch.Tensor         # [2, num_blocks, block_size, Hkv, D]
    query: torch.Tensor         # [T, Hq, D], padding rows included
    keys: list[torch.Tensor]    # per request [context_len, Hkv, D] (dtype of the cache)
    values: list[torch.Tensor]
    num_real: int               # sum of query lens; rows from here on are padding

    def describe(self, b: int) -> str:
        return f"req {b} (q={self.meta.query_lens_cpu[b]}, ctx={self.meta.seq_lens_cpu[b]})"


def scattered_batch(
    query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: torch.device | str, *, num_pad: int = 3, garbage: str = "random",
    extra_blocks: int = 3, seed: int = 0, q_scale: float = 1.0,
) -> Batch:
    """Requests own shuffled, non-contiguous physical blocks (block 0 stays the null block); everything no request
    owns (tails of last blocks, unused blocks, the null block) holds `garbage` ("random": large offset noise,
    "nan": NaN); block-table columns past a request's blocks point at random blocks. `num_pad` padding rows
    (slot -1) follow the real tokens; with garbage="nan" their queries are NaN too."""
    assert len(query_lens) == len(context_lens) and all(1 <= q <= c for q, c in zip(query_lens, context_lens))
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    gcpu = torch.Generator().manual_seed(seed)
    nblk = [-(-c // block_size) for c in context_lens]
    num_blocks = 1 + sum(nblk) + extra_blocks
    perm = (torch.randperm(num_blocks - 1, generator=gcpu) + 1).tolist()
    cols = max(nblk) + 1
    table = torch.randint(0, num_blocks, (len(query_lens), cols), generator=gcpu, dtype=torch.int32)  # stale ids
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if garbage == "nan":
        cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    else:
        cache = (torch.randn(shape, generator=g, device=device) * 50 + 10).to(dtype)
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    keys, values, step_slots = [], [], []
    used = 0
    for b, (q, c) in enumerate(zip(query_lens, context_lens)):
        ids = perm[used:used + nblk[b]]
        used += nblk[b]
        table[b, :nblk[b]] = torch.tensor(ids, dtype=torch.int32)
        slots = [ids[p // block_size] * block_size + p % block_size for p in range(c)]
        k = torch.randn(c, num_kv_heads, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(c, num_kv_heads, head_dim, generator=g, device=device).to(dtype)
        idx = torch.tensor(slots, dtype=torch.int64, device=device)
        flat[0].index_copy_(0, idx, k)
        flat[1].index_copy_(0, idx, v)
        keys.append(k)
        values.append(v)
        step_slots += slots[c - q:]
    num_real = sum(query_lens)
    query = torch.randn(num_real + num_pad, num_heads, head_dim, generator=g, device=device) * q_scale
    if garbage == "nan":
        query[num_real:] = math.nan
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        num_reqs=len(query_lens), num_tokens=num_real + num_pad, max_query_len=max(query_lens),
        max_seq_len=max(context_lens), block_size=block_size,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(step_slots + [-1] * num_pad, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(context_lens),
    )
    return Batch(meta, cache, query.to(dtype), keys, values, num_real)


def _dense_softcap_ref(batch: Batch, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Per-request dense fp32 attention from the logical K/V (used only while the paged reference lacks softcap)."""
    meta, out = batch.meta, torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    start = 0
    for b, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        q = batch.query[start:start + q_len].float()                       # [q, Hq, D]
        group = q.shape[1] // batch.keys[b].shape[1]
        k = batch.keys[b].float().repeat_interleave(group, dim=1)           # [s, Hq, D]
        v = batch.values[b].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qp = torch.arange(s_len - q_len, s_len, device=q.device)[:, None]
        kp = torch.arange(s_len, device=q.device)[None, :]
        allowed = kp <= qp
        if window is not None:
            allowed &= kp > qp - window
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
        start += q_len
    return out


def reference(batch: Batch, scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """fp32 reference on the same (already rounded) inputs the kernel sees: [T, Hq, D] float32."""
    if softcap is not None and not _REF_HAS_SOFTCAP:
        return _dense_softcap_ref(batch, scale, window, softcap)
    kwargs = {} if softcap is None else {"softcap": softcap}
    return paged_attention_ref(batch.query.float(), batch.cache.float(), batch.meta, scale, window, **kwargs)


def check_close(out: torch.Tensor, ref: torch.Tensor, batch: Batch, what: str) -> None:
    """Compare the real rows; on failure name the worst element and the max error of every request."""
    assert out.shape == batch.query.shape, f"{what}: output shape {tuple(out.shape)} != {tuple(batch.query.shape)}"
    assert out.dtype == batch.query.dtype, f"{what}: output dtype {out.dtype} != {batch.query.dtype}"
    n, tol = batch.num_real, TOLERANCE[batch.query.dtype]
    got, exp = out[:n].float(), ref[:n].float()
    err = (got - exp).abs().nan_to_num(nan=math.inf)                     # [n, Hq, D]
    bad = err > tol + tol * exp.abs()
    if not bool(bad.any()):
        return
    qsl = batch.meta.query_start_loc.tolist()
    lines = []
    for b in range(batch.meta.num_reqs):
        e = err[qsl[b]:qsl[b + 1]]
        if bool((e > tol + tol * exp[qsl[b]:qsl[b + 1]].abs()).any()):
            lines.append(f"  {batch.describe(b)}: max err {float(e.max()):.3g}, "
                         f"non-finite {int((~torch.isfinite(got[qsl[b]:qsl[b + 1]])).sum())}")
    t, h, d = (int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    raise AssertionError(
        f"{what}: {int(bad.sum())}/{bad.numel()} elements off (tol {tol}); worst {float(err[t, h, d]):.3g} at token {t} "
        f"head {h} dim {d} (got {float(got[t, h, d]):.5g}, ref {float(exp[t, h, d]):.5g}); query {tuple(out.shape)}, "
        f"cache {tuple(batch.cache.shape)}\n" + "\n".join(lines))


def run_and_check(batch: Batch, *, window: int | None = None, softcap: float | None = None,
                  num_splits: int | None = 1, what: str = "") -> None:
    """num_splits=None uses choose_num_splits' value for the batch."""
    meta, scale = batch.meta, batch.query.shape[-1] ** -0.5
    if num_splits is None:
        num_splits = choose_num_splits(meta.num_reqs, batch.cache.shape[3], meta.max_seq_len)
        assert isinstance(num_splits, int) and num_splits >= 1
    out = unified_attention(batch.query, batch.cache, meta, scale, sliding_window=window, softcap=softcap,
                            num_splits=num_splits)
    ref = reference(batch, scale, window, softcap)
    check_close(out, ref, batch, f"{what} window={window} softcap={softcap} splits={num_splits}")


def mixed_lens(block_size: int, long: int | None = None) -> tuple[list[int], list[int]]:
    """Decodes and prefill chunks (fresh and over cached prefixes) at block boundaries, interleaved."""
    bs = block_size
    pairs = [(1, 1), (5, 5), (1, bs - 1), (2, bs + 1), (1, bs), (17, 2 * bs + 3), (1, bs + 1), (2, 2), (5, bs),
             (1, 3 * bs + 5), (17, 17)]
    if long is not None:
        pairs += [(1, long), (128, 128), (2, long - 1), (128, long), (1, long - bs + 1), (17, long + 3),
                  (128, 128 + bs - 1), (5, bs + 1)]
    return [q for q, _ in pairs], [c for _, c in pairs]


# ----------------------------------------------------------------------------- small subset (CPU interpreter)

@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,dtype,num_splits", [
    (16, 2, 2, torch.float32, 1),     # MHA
    (32, 4, 2, HALF, 1),              # GQA 2
    (16, 8, 2, torch.float32, 3),     # GQA 4, split KV
    (16, 8, 1, HALF, 3),              # GQA 8 (MQA), split KV
    (32, 6, 2, torch.float32, None),  # GQA 3 (not a power of two), choose_num_splits
])
def test_mixed_batch(block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                     num_splits: int | None) -> None:
    q_lens, c_lens = mixed_lens(block_size)
    batch = scattered_batch(q_lens, c_lens, num_heads, num_kv_heads, 64, block_size, dtype, DEVICE, seed=block_size)
    run_and_check(batch, num_splits=num_splits, what=f"mixed bs={block_size} hq={num_heads} hkv={num_kv_heads}")


@pytest.mark.parametrize("window,softcap,num_splits", [(7, None, 1), (20, None, 3), (None, 5.0, 1), (7, 5.0, 3)])
def test_window_and_softcap(window: int | None, softcap: float | None, num_splits: int) -> None:
    q_lens, c_lens = [1, 17, 1, 5, 2], [70, 40, 6, 21, 33]
    batch = scattered_batch(q_lens, c_lens, 4, 2, 64, 16, torch.float32, DEVICE, seed=7, q_scale=3.0)
    run_and_check(batch, window=window, softcap=softcap, num_splits=num_splits, what="window/softcap")


@pytest.mark.parametrize("kind", ["decode_only", "prefill_only"])
def test_uniform_batches(kind: str) -> None:
    """All-decode and all-prefill launches (a kernel may take a different path for max_query_len == 1)."""
    if kind == "decode_only":
        q_lens, c_lens = [1] * 6, [1, 15, 16, 17, 33, 64]
    else:
        q_lens, c_lens = [17, 5, 16], [17, 21, 48]
    batch = scattered_batch(q_lens, c_lens, 4, 1, 64, 16, torch.float32, DEVICE, seed=3)
    for splits in (1, 3):
        run_and_check(batch, num_splits=splits, what=kind)


def test_split_prefill_tile_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split launches with prefill chunks may use taller query tiles (SPLIT_PREFILL_ROWS; 64, the default, is
    covered above): the same outputs for a chunk of one tile plus one query over a cached prefix, beside a decode
    and a short chunk."""
    monkeypatch.setattr(triton_attention, "SPLIT_PREFILL_ROWS", 128)
    q_lens, c_lens = [1, 65, 3], [100, 65 + 40, 90]
    batch = scattered_batch(q_lens, c_lens, 4, 2, 64, 16, torch.float32, DEVICE, seed=128)
    run_and_check(batch, num_splits=3, what="split prefill rows=128")


def test_contiguous_batch_layout() -> None:
    """The layout of graphrunner.attention.testing.contiguous_batch (consecutive blocks, zeroed cache)."""
    q_lens, c_lens = [1, 5, 1], [9, 37, 32]
    meta, cache = contiguous_batch(q_lens, c_lens, 1, 2, 64, 16, torch.float32, DEVICE)
    cache[0].normal_()
    query = torch.randn(meta.num_tokens, 4, 64, device=DEVICE)
    out = unified_attention(query, cache[0], meta, 0.125)
    ref = paged_attention_ref(query, cache[0], meta, 0.125)
    torch.testing.assert_close(out, ref, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_in_unused_slots_does_not_poison(num_splits: int) -> None:
    """Tails of last blocks, unused blocks, the null block, stale table entries and padding queries are NaN."""
    q_lens, c_lens = [1, 17, 1, 2, 1], [1, 19, 15, 33, 64]
    batch = scattered_batch(q_lens, c_lens, 4, 2, 64, 16, torch.float32, DEVICE, garbage="nan", seed=11)
    flat = batch.cache.view(2, -1, 2, 64)
    assert bool(flat.isnan().any()) and not bool(batch.query[:batch.num_real].isnan().any())
    out = unified_attention(batch.query, batch.cache, batch.meta, 0.125, num_splits=num_splits)
    real = out[:batch.num_real]
    assert bool(torch.isfinite(real).all()), (
        f"non-finite outputs for real tokens at rows {sorted(set((~torch.isfinite(real)).nonzero()[:, 0].tolist()))}")
    check_close(out, reference(batch, 0.125), batch, f"NaN garbage splits={num_splits}")


def test_splits_past_the_last_key_change_no_bit() -> None:
    """A FULL graph's split count is fixed for max_model_len, so short contexts leave splits without a key: they
    must add nothing to the merge, whether they store a zero partial output or none (the workspace may hold NaN
    from an earlier tensor here). Up to 4 tiles of keys, 4 and 16 splits cut the range into the same tiles, so
    the outputs are the same bits."""
    tile = triton_attention.TILE_N
    c_lens = [1, 37, 2 * tile + 5, 4 * tile, 3 * tile - 1]
    batch = scattered_batch([1] * len(c_lens), c_lens, 4, 2, 64, 16, torch.float32, DEVICE, garbage="nan", seed=5)
    outs = []
    for num_splits in (4, 16):
        poison = torch.full((1 << 20,), float("nan"), device=DEVICE)  # freed: the workspace may reuse its memory
        del poison
        outs.append(unified_attention(batch.query, batch.cache, batch.meta, 0.125, num_splits=num_splits))
    real = slice(0, batch.num_real)
    assert bool(torch.isfinite(outs[1][real]).all())
    assert torch.equal(outs[0][real], outs[1][real])
    check_close(outs[1], reference(batch, 0.125), batch, "16 splits over short contexts")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    """Scattered slots, padding (-1) interleaved; the null block and every other slot keep their contents."""
    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, hkv, d = 6, 16, 2, 64
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    cache[:, 0] = 7.0
    slots = torch.randperm((num_blocks - 1) * block_size, generator=g)[:23] + block_size  # never the null block
    slots = torch.cat([slots[:10], torch.tensor([-1]), slots[10:], torch.tensor([-1, -1])])
    k = torch.randn(slots.numel(), hkv, d, generator=g).to(dtype)
    v = torch.randn(slots.numel(), hkv, d, generator=g).to(dtype)
    expected = cache.clone()
    write_kv_ref(k, v, expected, slots)
    got = cache.to(DEVICE)
    write_kv_triton(k.to(DEVICE), v.to(DEVICE), got, slots.to(DEVICE))
    assert torch.equal(got.cpu(), expected), (
        f"write_kv_triton differs at {int((got.cpu() != expected).sum())} elements")
    assert bool((got[:, 0] == 7.0).all()), "the null block was written"


def test_choose_num_splits_is_a_positive_int() -> None:
    for num_reqs, hkv, seq in [(1, 8, 1), (1, 8, 8192), (256, 8, 512), (3, 1, 70)]:
        n = choose_num_splits(num_reqs, hkv, seq)
        assert isinstance(n, int) and n >= 1, (num_reqs, hkv, seq, n)


# ----------------------------------------------------------------------------- full matrix (GPU, real shapes)

GQA = [(8, 8), (8, 4), (8, 2), (8, 1), (6, 2)]  # ratios 1, 2, 4, 8, 3


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_matrix(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype,
                    num_splits: int | None) -> None:
    q_lens, c_lens = mixed_lens(block_size, long=8192)
    batch = scattered_batch(q_lens, c_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda",
                            num_pad=5, seed=head_dim + block_size)
    run_and_check(batch, num_splits=num_splits,
                  what=f"D={head_dim} hq={num_heads} hkv={num_kv_heads} bs={block_size} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,softcap", [(7, None), (1000, None), (None, 30.0), (100, 30.0)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_window_softcap(head_dim: int, num_heads: int, num_kv_heads: int, window: int | None,
                            softcap: float | None, dtype: torch.dtype, num_splits: int) -> None:
    q_lens, c_lens = mixed_lens(16, long=8192)
    batch = scattered_batch(q_lens, c_lens, num_heads, num_kv_heads, head_dim, 16, dtype, "cuda", seed=1, q_scale=4.0)
    run_and_check(batch, window=window, softcap=softcap, num_splits=num_splits,
                  what=f"D={head_dim} hq={num_heads} hkv={num_kv_heads} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_gpu_fp16_and_nan_garbage(num_splits: int | None) -> None:
    q_lens, c_lens = mixed_lens(16, long=8192)
    batch = scattered_batch(q_lens, c_lens, 16, 8, 128, 16, torch.float16, "cuda", garbage="nan", seed=2)
    run_and_check(batch, num_splits=num_splits, what="fp16, NaN garbage")


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 7, 256])
def test_gpu_decode_batches(num_reqs: int) -> None:
    """Pure decode at serving batch sizes with choose_num_splits (Qwen3-0.6B attention shape)."""
    gen = torch.Generator().manual_seed(num_reqs)
    c_lens = torch.randint(1, 3000, (num_reqs,), generator=gen).tolist()
    batch = scattered_batch([1] * num_reqs, c_lens, 16, 8, 128, 16, torch.bfloat16, "cuda", seed=num_reqs)
    run_and_check(batch, num_splits=None, what=f"decode x{num_reqs}")
