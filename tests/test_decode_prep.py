"""The attention prologue folded into decode attention (graphrunner/attention/decode_prep.py,
GRAPHRUNNER_ATTN_DECODE_PREP): attention straight from the fused projection against the prologue's reference then the
attention reference, and the cache it writes against the reference's, on awkward sizes (GQA groups 1-3, head dims
not a power of two, contexts of one key to several splits, a padding slot, a sliding window), norms on and off;
refused input; and an engine whose decode steps take this path giving the unfolded engine's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from graphrunner.attention import decode_prep
from graphrunner.attention.decode_prep import DecodePrep
from graphrunner.attention.reference import paged_attention_ref
from graphrunner.attention.testing import contiguous_batch
from graphrunner.attention.triton_attention import unified_attention_prepped
from graphrunner.models import qkv_prep
from graphrunner.models.qkv_prep import qkv_prep_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter multiplies the raw bit patterns of bfloat16 `tl.dot` operands (see test_attention_triton):
# half precision is bfloat16 on CUDA and float16 under the interpreter
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(ctx_lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, seed: int):
    """A decode step (one query per request) over caches filled with random earlier keys/values."""
    g = torch.Generator().manual_seed(seed)
    meta, cache = contiguous_batch([1] * len(ctx_lens), ctx_lens, 1, hkv, d, 16, dtype, DEVICE)
    cache = torch.randn(cache[0].shape, generator=g).to(dtype).to(DEVICE)  # earlier tokens (and stale slots)
    t = len(ctx_lens)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype).to(DEVICE)
    angles = torch.rand(t, 1, d // 2, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    qn, kn = ((torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE) for _ in range(2)) if norm else (None, None)
    return meta, cache, DecodePrep(qkv, cos, sin, qn, kn, 1e-6, meta.slot_mapping)


def _reference(prep: DecodePrep, cache: torch.Tensor, meta, hq: int, hkv: int, d: int,
               window: int | None) -> torch.Tensor:
    q = qkv_prep_ref(prep.qkv, prep.cos, prep.sin, prep.q_norm, prep.k_norm, prep.eps, cache, prep.slot_mapping, hq,
                     hkv, d)
    return paged_attention_ref(q.view(-1, hq, d), cache, meta, d ** -0.5, window)


@pytest.mark.parametrize(("ctx_lens", "hq", "hkv", "d"), [
    ([1], 1, 1, 16),              # one key: the new one alone
    ([5, 17, 33], 6, 3, 20),      # GQA 2, half of D not a power of two, a context past one block
    ([70, 129, 2], 12, 4, 24),    # GQA 3: the new key in the last of several splits
    ([64, 65], 4, 4, 32),         # a context of exactly one 64-key tile, and one key past it
])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_matches_prologue_then_attention(ctx_lens: list[int], hq: int, hkv: int, d: int, splits: int, norm: bool,
                                         dtype: torch.dtype) -> None:
    meta, cache, prep = _case(ctx_lens, hq, hkv, d, dtype, norm, seed=sum(ctx_lens) + d + splits)
    ref_cache, got_cache = cache.clone(), cache.clone()
    expected = _reference(prep, ref_cache, meta, hq, hkv, d, None)
    out = torch.full((len(ctx_lens), hq, d), float("nan"), dtype=dtype, device=DEVICE)
    unified_attention_prepped(prep, got_cache, meta, d ** -0.5, None, splits, out)
    torch.testing.assert_close(out, expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    torch.testing.assert_close(got_cache, ref_cache, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    # v goes into the cache unchanged, bit for bit
    v_rows = prep.qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    flat_v = got_cache[1].view(-1, hkv, d)
    for i, s in enumerate(prep.slot_mapping.tolist()):
        assert torch.equal(flat_v[s], v_rows[i])


def test_padding_slot_is_not_written_and_window_applies() -> None:
    """A request whose slot is -1 (a padded row of a captured batch) leaves the cache as it was; a sliding window
    limits the keys as in the reference."""
    hq, hkv, d, dtype = 4, 2, 16, torch.float32
    meta, cache, prep = _case([40, 23], hq, hkv, d, dtype, True, seed=7)
    slots = prep.slot_mapping.clone()
    slots[0] = -1
    prep = DecodePrep(prep.qkv, prep.cos, prep.sin, prep.q_norm, prep.k_norm, prep.eps, slots)
    ref_cache, got_cache = cache.clone(), cache.clone()
    expected = _reference(prep, ref_cache, meta, hq, hkv, d, 9)
    out = torch.empty(2, hq, d, dtype=dtype, device=DEVICE)
    unified_attention_prepped(prep, got_cache, meta, d ** -0.5, 9, 2, out)
    torch.testing.assert_close(got_cache, ref_cache, atol=1e-4, rtol=2e-5)
    # the padded request's row keeps the cache's stale contents, which its own attention read as the newest key
    # in the reference; the folded kernel uses the projection's key there, so only request 1 is compared
    torch.testing.assert_close(out[1], expected[1], atol=1e-4, rtol=2e-5)
    assert torch.equal(got_cache.view(2, -1, hkv, d)[:, int(meta.slot_mapping[0])],
                       cache.view(2, -1, hkv, d)[:, int(meta.slot_mapping[0])])


def test_bad_input_is_refused() -> None:
    meta, cache, prep = _case([5, 9], 4, 2, 16, torch.float32, True, seed=1)
    out = torch.empty(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        DecodePrep(prep.qkv, prep.cos, prep.sin, prep.q_norm, None, 1e-6, prep.slot_mapping)
    with pytest.raises(ValueError, match=r"qkv \(2, 100\) must be \[2, 128\]"):
        unified_attention_prepped(DecodePrep(torch.zeros(2, 100, device=DEVICE), prep.cos, prep.sin, None, None,
                                             1e-6, prep.slot_mapping), cache, meta, 0.25, None, 1, out)
    with pytest.raises(ValueError, match="cos/sin must be"):
        unified_attention_prepped(DecodePrep(prep.qkv, prep.cos[:1], prep.sin[:1], None, None, 1e-6,
                                             prep.slot_mapping), cache, meta, 0.25, None, 1, out)
    prefill, pcache = contiguous_batch([3], [5], 1, 2, 16, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="serves decode steps"):
        unified_attention_prepped(prep, pcache[0], prefill, 0.25, None, 1, out)


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_engine_tokens_equal_with_the_folded_prologue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      arch: str) -> None:
    """Greedy tokens of an engine on the triton backend with the prologue kernel (GRAPHRUNNER_ATTN_DECODE_PREP off)
    and with its decode steps folded (on); prefill steps take the prologue kernel in both."""
    from graphrunner import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path, arch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [100, 7, 8, 9, 10] * 4, [3]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kwargs = {"max_model_len": 64, "attention_backend": "triton", "block_size": 4, "max_num_batched_tokens": 16}
    if torch.cuda.is_available():
        kwargs["device"] = "cuda"
    monkeypatch.setattr(qkv_prep, "KERNEL_UNDER_INTERPRETER", True)
    folded = [0]
    attend_prepped = qkv_prep.attend_prepped

    def counting(*args: object) -> None:
        folded[0] += 1
        attend_prepped(*args)

    monkeypatch.setattr(qkv_prep, "attend_prepped", counting)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(decode_prep, "DECODE_PREP", on)
        runs.append([o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)])
        assert (folded[0] > 0) == on
    assert runs[0] == runs[1]
