"""Tests for tools/kernel_table.py (the grouping behind bench_step_breakdown.py's kernel table): kernel names land in
issue 17's groups, the GEMM right before each step's sampling kernel (with its split-K reduce) becomes lm_head, and
the per-step / per-token figures add up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tool_loader import load_tool

kt = load_tool("kernel_table")


@pytest.mark.parametrize(("name", "group"), [
    ("nvjet_tst_64x8_64x16_2x1_v_bz_splitK_TNT", "GEMMs (layers)"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMMs (layers)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "GEMMs (layers)"),
    ("_gemv_kernel", "GEMMs (layers)"),
    ("_split_k_reduce_kernel", "GEMMs (layers)"),
    ("_unified_attention_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),
    ("_sample_kernel", "sampling"),
    ("_split_sample_partial_kernel", "sampling"),
    ("triton_poi_fused_add_mul_silu_0", "inductor fused"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "inductor fused"),
    ("_write_kv_kernel", "kv write / memcpy"),
    ("_qkv_prep_kernel", "kv write / memcpy"),
    ("_rms_norm_kernel", "inductor fused"),
    ("Memcpy DtoD (Device -> Device)", "kv write / memcpy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::isfinite>", "other"),
    ("_post_update_kernel", "other"),
])
def test_classify(name: str, group: str) -> None:
    assert kt.classify(name) == group


def _step(t0: float, split_k_lm_head: bool) -> list:
    ev = kt.KernelEvent
    out = [ev("triton_red_fused_rms_0", t0, 2.0), ev("nvjet_qkv", t0 + 3, 5.0), ev("_write_kv_kernel", t0 + 9, 1.0),
           ev("_unified_attention_kernel", t0 + 11, 8.0), ev("nvjet_o", t0 + 20, 4.0)]
    if split_k_lm_head:
        out += [ev("nvjet_lm", t0 + 30, 70.0), ev("splitKreduce_kernel", t0 + 101, 2.0)]
    else:
        out += [ev("nvjet_lm", t0 + 30, 72.0)]
    out += [ev("elementwise_isfinite", t0 + 104, 1.0), ev("_sample_kernel", t0 + 106, 80.0),
            ev("_post_update_kernel", t0 + 190, 1.0)]
    return out


@pytest.mark.parametrize("split_k_lm_head", [False, True])
def test_lm_head_is_the_gemm_before_sampling(split_k_lm_head: bool) -> None:
    events = _step(0.0, split_k_lm_head) + _step(1000.0, split_k_lm_head)
    rows = kt.kernel_rows(list(reversed(events)))  # input order must not matter
    by_name = {r.name: r for r in rows}
    assert by_name["nvjet_lm"].group == "lm_head GEMM" and by_name["nvjet_lm"].calls == 2
    assert by_name["nvjet_qkv"].group == by_name["nvjet_o"].group == "GEMMs (layers)"
    assert by_name["_sample_kernel"].group == "sampling"
    if split_k_lm_head:
        assert by_name["splitKreduce_kernel"].group == "lm_head GEMM"
    summary = kt.summarize(rows, steps=2, tokens_per_step=4)
    assert summary["groups"]["lm_head GEMM"]["us_per_step"] == pytest.approx(72.0)
    assert summary["groups"]["lm_head GEMM"]["us_per_token"] == pytest.approx(18.0)
    assert summary["groups"]["GEMMs (layers)"]["calls_per_step"] == 2
    assert summary["device_us_per_step"] == pytest.approx(sum(e.dur_us for e in events) / 2)
    text = kt.format_table(summary)
    assert "lm_head GEMM" in text and "_sample_kernel" in text and "device total" in text


def test_empty_profile() -> None:
    summary = kt.summarize(kt.kernel_rows([]), steps=3, tokens_per_step=1)
    assert summary["device_us_per_step"] == 0 and all(g["calls_per_step"] == 0 for g in summary["groups"].values())
    assert "device total" in kt.format_table(summary)


def test_events_from_chrome_trace(tmp_path: Path) -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 9.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 2.0, "dur": 3.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8", "ts": 10.0, "dur": 5.5},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 16.0, "dur": 1.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 17.5, "dur": 0.5},
        {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 18.0},
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    events = kt.events_from_chrome_trace(path)
    assert [(e.name, e.dur_us) for e in events] == [("nvjet_tst_64x8", 5.5), ("Memcpy DtoD (Device -> Device)", 1.0),
                                                   ("Memset (Device)", 0.5)]
    assert [kt.classify(e.name) for e in events] == ["GEMMs (layers)", "kv write / memcpy", "kv write / memcpy"]


def test_critical_path_charges_only_the_exposed_tail() -> None:
    """Three overlapping kernels (PDL) and one between-step gap: each is charged what it adds past the latest end
    before it, a small gap is idle, a long one is left out, and the charges add up to the covered span."""
    E = kt.KernelEvent
    step = [E("_add_rms_norm_kernel", 0.0, 3.0),  # 0-3
            E("_gemv_kernel", 1.0, 6.0),          # 1-7: 4 past the norm
            E("_unified_attention_kernel", 2.0, 4.0),  # 2-6: ends before the GEMV, so it is charged 3-6
            E("_gemv_kernel", 9.0, 2.0)]          # 9-11: 2 idle, then 2
    later = [E(e.name, e.start_us + 1000.0, e.dur_us) for e in step]  # a second step after a 989 µs host gap
    path = kt.critical_path(step + later, steps=2)
    per = path["us_per_step"]
    assert per["add_rms_norm_kernel after start"] == pytest.approx(3.0 / 2)
    assert per["add_rms_norm_kernel after gemv_kernel"] == pytest.approx(3.0 / 2)
    assert per["unified_attention_kernel after add_rms_norm_kernel"] == pytest.approx(3.0)  # 2-6 past 3
    assert per["gemv_kernel after unified_attention_kernel"] == pytest.approx(1.0)  # 6-7
    assert per["gemv_kernel after gemv_kernel"] == pytest.approx(2.0)
    assert per["idle"] == pytest.approx(2.0)
    assert path["span_us_per_step"] == pytest.approx(11.0)
