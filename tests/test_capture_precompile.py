"""Offline precompilation on CPU (Inductor C++): a manifest that does not match this run is refused
naming the field; a precompiled directory gives a warm start that loads the saved compilation without tracing
(capture/aot.py), or, where that artifact is stale, corrupt or turned off, compiles from cache hits only; every
way generates the same tokens as eager.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from capture import aot
from capture.manifest import MANIFEST_NAME, Manifest, code_key
from graphrunner import LLM

WARM_SCRIPT = """
import json, sys
from torch._dynamo.utils import counters
from graphrunner import LLM, SamplingParams
llm = LLM(model=sys.argv[1], compile_cache=sys.argv[2], num_gpu_blocks_override=64, max_model_len=256,
          device=sys.argv[3], dtype="float32", compilation_config={"backend": "inductor"})
out = llm.generate([[5, 6, 7, 8, 9], [3], list(range(40, 70))],
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "inductor": dict(counters["inductor"]),
                  "traced": counters["stats"]["unique_graphs"], "model": type(llm.engine.runner.model).__name__,
                  "retraced": getattr(llm.engine.runner.model, "retraced", None)}))
"""
PROMPTS = [[5, 6, 7, 8, 9], [3], list(range(40, 70))]  # a prefill, a one-token prompt, a longer one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("precompile"), "Qwen3ForCausalLM")


def _manifest_dir(tmp_path: Path, model_dir: Path, **changes: object) -> Path:
    manifest = Manifest.current(model_dir, torch.float32, torch.device("cpu"), ())  # CPU: no graphs
    dataclasses.replace(manifest, **changes).save(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("changes", "field"), [
    ({"torch_version": "1.0.0"}, "torch_version"),
    ({"device_name": "NVIDIA H200", "device_capability": "9.0"}, "device_name"),
    ({"model_hash": "0" * 64}, "model_hash"),
    ({"capture_sizes": (1, 2, 4)}, "capture_sizes"),
    ({"full_sizes": (1, 2)}, "full_sizes"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"compile_backend": "inductor"}, "compile_backend"),
])
def test_mismatched_manifest_is_refused_naming_the_field(tmp_path: Path, model_dir: Path, changes: dict,
                                                         field: str) -> None:
    cache = _manifest_dir(tmp_path, model_dir, **changes)
    with pytest.raises(ValueError, match=f"different setup.*{field}: cache has") as refused:
        LLM(model=model_dir, compile_cache=cache, num_gpu_blocks_override=16)
    # only a piece-compiler mismatch says which compilation_config the directory would load under
    assert ("""-O '{"backend": "inductor"}'""" in str(refused.value)) == (field == "compile_backend")


def test_dtype_mismatch_and_missing_manifest_are_refused(tmp_path: Path, model_dir: Path) -> None:
    cache = _manifest_dir(tmp_path, model_dir)
    with pytest.raises(ValueError, match="dtype: cache has 'float32', this run has 'bfloat16'"):
        LLM(model=model_dir, compile_cache=cache, dtype="bfloat16", num_gpu_blocks_override=16)
    (cache / MANIFEST_NAME).unlink()
    with pytest.raises(ValueError, match="has no manifest.json"):
        LLM(model=model_dir, compile_cache=cache, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="contradict"):
        LLM(model=model_dir, compile_cache=cache, enforce_eager=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_precompile_then_warm_start_hits_the_cache(tmp_path: Path, model_dir: Path, device: str) -> None:
    cache = tmp_path / "cache"
    pre = subprocess.run([sys.executable, "-m", "graphrunner", "precompile", "--model", str(model_dir), "--out",
                          str(cache), "--max-model-len", "256", "--device", device, "--dtype", "float32",
                          "--num-gpu-blocks-override", "64", "--compilation-config", '{"backend": "inductor"}'], capture_output=True, text=True, timeout=600,
                         check=False)
    assert pre.returncode == 0, pre.stderr
    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    assert (manifest["device_name"] == "cpu") == (device == "cpu"), manifest
    assert (cache / aot.MODEL_FILE).is_file() and (cache / aot.KEY_FILE).is_file()
    eager = LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=256, device=device, dtype="float32",
                enforce_eager=True)
    from graphrunner import SamplingParams

    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                                     ignore_eos=True))]

    def warm(**env: str) -> dict:
        run = subprocess.run([sys.executable, "-c", WARM_SCRIPT, str(model_dir), str(cache), device],
                             capture_output=True, text=True, timeout=600, check=False, env={**os.environ, **env})
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["tokens"] == expected
        return result

    loaded = warm()  # the saved compilation: no Dynamo trace, no Inductor cache lookups
    assert loaded["model"] == "AOTCompiledModel" and loaded["traced"] == 0 and not loaded["retraced"], loaded
    assert not any(k.startswith("fxgraph_cache") for k in loaded["inductor"]), loaded["inductor"]
    off = warm(GRAPHRUNNER_AOT="0")  # turned off: the engine traces, and Inductor's cache serves every piece
    assert off["model"] == "OptimizedModule" and off["traced"] >= 1, off
    assert off["inductor"].get("fxgraph_cache_miss", 0) == 0, off["inductor"]
    assert off["inductor"].get("fxgraph_cache_hit", 0) > 0, off["inductor"]
    # traced with another switch (here the unfused attention prologue: another graph, which Dynamo would not have
    # caught, since it keeps module-level switches as constants without guards): traced again, eager's tokens
    other = warm(GRAPHRUNNER_FUSED_QKV_PREP="0")
    assert other["model"] == "OptimizedModule" and other["traced"] >= 1, other
    # global state the saved guards check (here the CPU thread count: 1 against precompile's default): the first
    # call is refused, and the model is traced again through the same backend before any graph is captured
    refused = warm(OMP_NUM_THREADS="1")
    assert refused["model"] == "AOTCompiledModel" and refused["retraced"] and refused["traced"] >= 1, refused
    if device == "cpu":  # an artifact that does not load is not used either (the GPU run has shown the rest)
        (cache / aot.MODEL_FILE).write_bytes(b"not a compiled function")
        assert warm()["model"] == "OptimizedModule"


def test_aot_key_follows_code_switches_but_not_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    base = code_key()
    monkeypatch.setenv("GRAPHRUNNER_LOG_LEVEL", "INFO")
    assert code_key() == base
    monkeypatch.setenv("GRAPHRUNNER_FUSED_ADD_NORM", "0")
    assert code_key() != base


def test_manifest_records_the_graph_sizes_of_the_config(model_dir: Path) -> None:
    from capture.compiled import graph_sizes, manifest_for, mixed_graph_sizes
    from graphrunner.engine_args import build_engine_config
    from graphrunner.worker import build_model_state

    cpu = build_engine_config(model=model_dir, device="cpu", max_model_len=256)
    state = build_model_state(cpu)
    assert graph_sizes(cpu, state) == ([], []) and manifest_for(cpu, state).capture_sizes == ()
    # graph sizes depend only on the config: a CUDA config can be inspected on a CPU machine
    cuda = dataclasses.replace(cpu, device=torch.device("cuda"), attention_backend="triton")
    full, buckets = graph_sizes(cuda, state)
    assert full[:4] == [1, 2, 4, 8] and full[-1] == 256 and buckets[-1] == 2048
    assert graph_sizes(dataclasses.replace(cuda, cudagraph_mode="piecewise"), state) == ([], buckets)
    assert graph_sizes(dataclasses.replace(cuda, enforce_eager=True), state) == ([], [])
    assert graph_sizes(dataclasses.replace(cuda, attention_backend="reference"), state)[0] == []
    # compilation_config's cudagraph_capture_sizes replaces the FULL decode sizes (those over max_num_seqs dropped)
    # (manifest_for records graph_sizes, so a precompiled directory is checked against them)
    asked = build_engine_config(model=model_dir, device="cpu", max_model_len=256, max_num_seqs=48,
                                compilation_config={"cudagraph_capture_sizes": [32, 1, 64, 8, 8]})
    assert asked.cudagraph_capture_sizes == (32, 1, 64, 8, 8)
    asked = dataclasses.replace(asked, device=torch.device("cuda"), attention_backend="triton")
    assert graph_sizes(asked, state) == ([1, 8, 32], buckets)
    # an empty list: no FULL graphs at all (mixed ones included), piecewise graphs as before
    none = dataclasses.replace(asked, cudagraph_capture_sizes=())
    assert graph_sizes(none, state) == ([], buckets) and mixed_graph_sizes(none, state) == []
