"""models/qkv_partials.py: the qkv projection's split-K partials summed by the attention prologue. The prologue
kernel fed partials gives the bits it gives fed their reference sum (awkward sizes, with and without bias and q/k
norms); partials summed are the split GEMV's own output; a tiny model's forward through the partials path equals
the forward through the split GEMV with its tail, bit for bit (reference and Triton prologues); the routing rule;
on a GPU, engines with the path on and off give the same tokens through eager and FULL graphs, and opcheck.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model, model_state_for

from graphrunner.models import gemv, qkv_partials, qkv_prep
from graphrunner.models import linear as linear_mod
from graphrunner.models.gemv import GemvConfig, gemv_triton, split_plan
from graphrunner.models.linear_add_norm import gemv_partials
from graphrunner.models.qkv_prep import qkv_prep_ref, qkv_prep_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584) and its bf16 casts may truncate: fp16 on CPU
HALF = [torch.float16] if DEVICE == "cpu" else [torch.float16, torch.bfloat16]


def _prologue_case(s: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, norm: bool, bias: bool,
                   seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    parts = (torch.randn(s, t, n, generator=g) * 2).to(DEVICE)  # [S, T, N] float32
    b = (torch.randn(n, generator=g)).to(dtype).to(DEVICE) if bias else None
    angles = torch.rand(t, 1, d // 2, generator=g) * 6.3
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    qn, kn = ([(torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE) for _ in range(2)] if norm
              else [None, None])
    cache = torch.randn(2, 6, 4, hkv, d, generator=g).to(dtype).to(DEVICE)  # stale contents
    slots = (torch.randperm(20, generator=g)[:t] + 4).to(DEVICE)
    if t > 2:
        slots[1] = -1  # a padding token
    return parts, b, cos, sin, qn, kn, cache, slots


@pytest.mark.parametrize(("s", "t", "hq", "hkv", "d"), [(1, 1, 1, 1, 2), (2, 3, 6, 3, 20), (3, 7, 4, 2, 32),
                                                        (2, 8, 3, 3, 64), (5, 2, 4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize(("norm", "bias"), [(False, False), (True, False), (True, True), (False, True)])
def test_prologue_from_partials_equals_prologue_from_their_sum(s: int, t: int, hq: int, hkv: int, d: int,
                                                               dtype: torch.dtype, norm: bool, bias: bool) -> None:
    parts, b, cos, sin, qn, kn, cache, slots = _prologue_case(s, t, hq, hkv, d, dtype, norm, bias, s * 31 + t + d)
    summed = qkv_partials.qkv_from_parts_ref(parts, b, dtype)  # [T, N]
    unwritten = torch.full_like(summed, float("nan"))  # never read on the partials path
    ours, theirs = cache.clone(), cache.clone()
    q = qkv_prep_triton(unwritten, cos, sin, qn, kn, 1e-6, ours, slots, hq, hkv, d, parts, b)
    want = qkv_prep_triton(summed, cos, sin, qn, kn, 1e-6, theirs, slots, hq, hkv, d)
    assert torch.equal(q, want) and torch.equal(ours, theirs)
    ref_cache = cache.clone()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(q, qkv_prep_ref(summed, cos, sin, qn, kn, 1e-6, ref_cache, slots, hq, hkv, d),
                               atol=4 * tol, rtol=tol)


def test_reference_sum_is_in_split_order_then_the_bias() -> None:
    parts = torch.tensor([[[1e8, 1.0]], [[1.0, -1e8]], [[-1e8, 1e8]]])  # [3, 1, 2]: order changes the float sums
    bias = torch.tensor([0.5, 0.25], dtype=torch.float16)
    got = qkv_partials.qkv_from_parts_ref(parts, bias, torch.float32)
    want = torch.stack([((0 + parts[0]) + parts[1]) + parts[2]])[0] + bias.float()
    assert torch.equal(got, want) and got.dtype == torch.float32


def test_prologue_refuses_bad_partials() -> None:
    parts, b, cos, sin, qn, kn, cache, slots = _prologue_case(2, 3, 4, 2, 16, torch.float32, True, True, 1)
    qkv = torch.zeros(3, 128, device=DEVICE)
    args = (qkv, cos, sin, qn, kn, 1e-6, cache, slots, 4, 2, 16)
    with pytest.raises(ValueError, match="parts"):
        qkv_prep_triton(*args, parts[:, :2], b)
    with pytest.raises(ValueError, match="parts must be"):
        qkv_prep_triton(*args, parts.half(), b)
    with pytest.raises(ValueError, match="bias has"):
        qkv_prep_triton(*args, parts, b[:5])
    with pytest.raises(ValueError, match="a bias goes with parts"):
        qkv_prep_triton(*args, None, b)


@pytest.mark.parametrize(("m", "n", "k", "config"), [
    (1, 96, 300, GemvConfig(4, 64, 2)),  # row loop, last split short
    (3, 160, 1030, GemvConfig(16, 64, 3)),
    (8, 80, 512, GemvConfig(16, 64, 2, use_dot=True)),
    (5, 100, 600, GemvConfig(32, 128, 4, num_stages=2, use_dot=True, swap_ab=True)),
])
@pytest.mark.parametrize("bias", [False, True])
def test_partials_summed_are_the_split_gemvs_output(m: int, n: int, k: int, config: GemvConfig, bias: bool) -> None:
    assert split_plan(k, config)[1] > 1
    g = torch.Generator().manual_seed(m + n + k)
    for dtype in HALF:
        x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
        b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
        got = qkv_partials.qkv_from_parts_ref(gemv_partials(x, w, config), b, dtype)
        assert torch.equal(got, gemv_triton(x, w, b, config))


def _table(n: int, k: int, *configs: GemvConfig) -> Callable[[], dict]:
    return lambda: {(n, k): configs}


def test_capacity_and_splits_at_follow_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    row, dot = GemvConfig(4, 64, 1, max_m=1), GemvConfig(64, 256, 2, max_m=8, use_dot=True, swap_ab=True)
    monkeypatch.setattr(gemv, "tuned_configs", _table(4096, 1024, row, dot))
    assert qkv_partials.capacity(4096, 1024) == 2 and qkv_partials.capacity(4096, 2048) == 0
    cuda = torch.device("cuda")
    monkeypatch.setattr(qkv_partials, "interpreted", lambda: False)  # (the rule, without a GPU)
    assert [qkv_partials.splits_at(m, 4096, 1024, cuda) for m in range(10)] == [0, 0] + [2] * 7 + [0]
    assert qkv_partials.splits_at(4, 4096, 1024, torch.device("cpu")) == 0
    assert qkv_partials.splits_at(4, 4096, 2048, cuda) == 0  # untuned: the small-M linear's own output
    monkeypatch.setattr(gemv, "tuned_configs", _table(4096, 1024, row, GemvConfig(64, 256, 1, use_dot=True)))
    assert qkv_partials.capacity(4096, 1024) == 0  # nothing splits: routes() keeps the plain projection


def test_cpu_weights_do_not_route_and_the_op_is_the_linear() -> None:
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    assert not qkv_partials.routes(x, w)
    qkv, parts = qkv_partials.qkv_projection(x, w, b)
    assert torch.equal(qkv, F.linear(x, w, b)) and parts.dtype == torch.float32


def _forward(model_dir: Path, dtype: torch.dtype, backend: str, lens: list[int], ctx_lens: list[int]) -> torch.Tensor:
    from graphrunner.attention import forward_context
    from graphrunner.attention.testing import contiguous_batch
    from graphrunner.config import ModelConfig
    from graphrunner.loader import load_model

    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, model_state_for(model_dir), dtype, torch.device(DEVICE))
    g = torch.Generator().manual_seed(9)
    meta, kv = contiguous_batch(lens, ctx_lens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, dtype, DEVICE)
    kv.copy_(torch.randn(kv.shape, generator=g))  # the cached prefix, the same for both runs
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g).to(DEVICE)
    pos = torch.cat([torch.arange(c - q, c) for q, c in zip(lens, ctx_lens)]).to(DEVICE)
    with torch.inference_mode(), forward_context(meta, kv, backend):
        return torch.cat([model(ids, pos).flatten(), kv.flatten()])


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU stand-in for the GPU's routing (on a GPU the GPU test runs)")
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])  # Qwen2: a qkv bias
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("lens", "ctx_lens"), [([1, 1, 1], [4, 9, 2]), ([3, 2], [3, 20]), ([6, 5], [6, 5])])
def test_model_through_partials_equals_the_split_gemv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                                      backend: str, lens: list[int], ctx_lens: list[int]) -> None:
    """The routing forced on CPU (fp16, the GEMV under the interpreter): the model's hidden states and KV cache
    through the partials path equal those of the split GEMV with its tail feeding the prologue, bit for bit;
    11 tokens (above the GEMV's 8) take the plain projection in both."""
    model_dir = make_tiny_model(tmp_path, arch)
    from graphrunner.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    n, k = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size
    split = GemvConfig(16, 32, 2)
    monkeypatch.setattr(gemv, "tuned_configs", _table(n, k, split))
    monkeypatch.setattr(qkv_prep, "KERNEL_UNDER_INTERPRETER", True)
    monkeypatch.setattr(qkv_partials, "interpreted", lambda: False)
    monkeypatch.setattr(qkv_partials.decode_prep, "DECODE_PREP", False)
    used: list[int] = []
    monkeypatch.setattr(qkv_partials, "parts_view", lambda p, s, m, nn: used.append(s) or p[: s * m * nn].view(s, m, nn))
    cpu = torch.device("cpu")
    real_splits_at = qkv_partials.splits_at
    monkeypatch.setattr(qkv_partials, "splits_at", lambda m, nn, kk, dev: real_splits_at(m, nn, kk, torch.device("cuda"))
                        if dev == cpu else 0)
    monkeypatch.setattr(qkv_partials, "routes_to_gemv", lambda w: w.shape == (n, k))
    ours = _forward(model_dir, torch.float16, backend, lens, ctx_lens)
    assert used == ([2] * 2 * cfg.num_layers if sum(lens) <= gemv.MAX_M else [])  # (producer, then prologue)

    monkeypatch.setattr(qkv_partials, "ENABLED", False)
    monkeypatch.setattr(linear_mod, "routes_to_gemv", lambda w: w.shape == (n, k))
    plain = gemv._small_m_linear
    monkeypatch.setattr(gemv, "_small_m_linear", lambda x, w, b: gemv_triton(x, w, b, split)
                        if w.shape == (n, k) and x.shape[0] <= gemv.MAX_M else plain(x, w, b))
    theirs = _forward(model_dir, torch.float16, backend, lens, ctx_lens)
    assert torch.equal(ours, theirs)


def test_bad_switch_value_is_refused() -> None:
    env = {**os.environ, "GRAPHRUNNER_QKV_PARTIALS": "yes"}
    got = subprocess.run([sys.executable, "-c", "import graphrunner.models.qkv_partials"], env=env,
                         capture_output=True, text=True, timeout=120, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    assert got.returncode != 0 and "GRAPHRUNNER_QKV_PARTIALS must be one of 0, 1, got 'yes'" in got.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engines_with_and_without_partials_give_the_same_tokens(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 tiny Qwen3 whose qkv weight splits K at 2-8 tokens: eager (compiled, no graphs) and FULL graphs give the
    same greedy tokens with the partials path on and off (the same float32 sums, one rounding), and it ran."""
    from graphrunner import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    from graphrunner.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    n, k = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size
    monkeypatch.setattr(gemv, "tuned_configs", _table(n, k, GemvConfig(4, 32, 1, max_m=1),
                                                      GemvConfig(16, 32, 2, max_m=8, use_dot=True, swap_ab=True)))
    used: list[int] = []
    view = qkv_partials.parts_view
    monkeypatch.setattr(qkv_partials, "parts_view", lambda *a: used.append(a[1]) or view(*a))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i)] for i in range(6)]
    tokens = {}
    for on in (True, False):
        monkeypatch.setattr(qkv_partials, "ENABLED", on)
        for mode, kw in (("eager", {"cudagraph_mode": "none"}), ("full", {})):
            llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=128, device="cuda", **kw)
            tokens[on, mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            del llm
        if on:
            assert used, "the partials path never ran"
    assert tokens[True, "eager"] == tokens[False, "eager"] == tokens[True, "full"] == tokens[False, "full"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_projection_op_passes_opcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "tuned_configs", _table(256, 128, GemvConfig(16, 32, 2, use_dot=True, swap_ab=True)))
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16) / 16
    qkv, parts = qkv_partials.qkv_projection(x, w, None)
    assert qkv.shape == (4, 256) and parts.shape == (2 * gemv.MAX_M * 256,)
    summed = qkv_partials.qkv_from_parts_ref(qkv_partials.parts_view(parts, 2, 4, 256), None, x.dtype)
    assert torch.equal(summed, gemv_triton(x, w, None, GemvConfig(16, 32, 2, use_dot=True, swap_ab=True)))
    # (one of the two outputs is always left unwritten, so opcheck's comparisons of outputs across calls cannot
    # hold: the schema and the fake's shapes, strides and dtypes are what it checks here, at 4 and at 9 tokens)
    for m in (4, 9):
        torch.library.opcheck(torch.ops.graphrunner.qkv_projection.default,
                              (torch.randn(m, 128, device="cuda", dtype=torch.bfloat16), w, None),
                              test_utils=("test_schema", "test_faketensor"))
