"""The uncompiled engine (vLLM's compilation level 0): alone it runs eagerly, with cudagraph_mode FULL it keeps the
FULL graphs of the model as it is. Neither imports Dynamo (nor sympy): a start-up without torch.compile pays for
neither. Precompiling it keeps the kernels, and a warm start from the directory checks that it was built uncompiled.
The GPU side (FULL graphs of the uncompiled model equal eager) is in tests/test_gpu_capture.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from capture.compiled import graph_sizes, mixed_graph_sizes
from capture.manifest import MANIFEST_NAME
from graphrunner.engine_args import build_engine_config
from graphrunner.worker import build_model_state

UNCOMPILED = {"level": 0, "cudagraph_mode": "FULL"}

# A fresh process: build an engine (optionally from a precompiled directory), generate, and report whether Dynamo or
# sympy was ever imported, with the tokens
NO_DYNAMO_SCRIPT = """
import json, sys
from graphrunner import LLM, SamplingParams
kw = {"compile_cache": sys.argv[2], "compilation_config": json.loads(sys.argv[3])} if len(sys.argv) > 2 else {}
llm = LLM(model=sys.argv[1], num_gpu_blocks_override=64, max_model_len=256, device="cpu", dtype="float32", **kw)
out = llm.generate([[5, 6, 7, 8, 9], [3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "torch_compile": llm.config.torch_compile,
                  "dynamo": "torch._dynamo" in sys.modules, "sympy": "sympy" in sys.modules}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("uncompiled"), "Qwen3ForCausalLM")


def _config(model_dir: Path, **kw: object):  # type: ignore[no-untyped-def]
    return build_engine_config(model=model_dir, device="cpu", max_model_len=256, **kw)


def test_compilation_levels_and_graph_modes(model_dir: Path) -> None:
    level0 = _config(model_dir, compilation_config=0)
    assert level0.enforce_eager and not level0.torch_compile  # vLLM's level 0: no compilation, no graphs
    full = _config(model_dir, compilation_config=UNCOMPILED)
    assert not full.enforce_eager and not full.torch_compile and full.cudagraph_mode == "full"
    assert _config(model_dir, compilation_config={"level": 0, "cudagraph_mode": "NONE"}).enforce_eager
    for name in ("FULL", "FULL_DECODE_ONLY"):  # vLLM's FULL modes: no piecewise graphs
        compiled = _config(model_dir, compilation_config={"cudagraph_mode": name})
        assert compiled.torch_compile and compiled.cudagraph_mode == "full" and not compiled.enforce_eager
    default = _config(model_dir)
    assert default.torch_compile and default.cudagraph_mode == "full_and_piecewise"


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_graphs_without_compilation_are_refused(model_dir: Path, mode: str) -> None:
    with pytest.raises(ValueError, match="piecewise graphs are of compiled pieces"):
        _config(model_dir, compilation_config={"level": 0, "cudagraph_mode": mode})
    with pytest.raises(ValueError, match="needs the compiled model"):
        dataclasses.replace(_config(model_dir), torch_compile=False, cudagraph_mode=mode.lower())


def test_full_mode_captures_full_graphs_only(model_dir: Path) -> None:
    config = _config(model_dir, compilation_config=UNCOMPILED)
    state = build_model_state(config)
    cuda = dataclasses.replace(config, device=torch.device("cuda"), attention_backend="triton")
    full, buckets = graph_sizes(cuda, state)
    default_full, default_buckets = graph_sizes(dataclasses.replace(cuda, cudagraph_mode="full_and_piecewise",
                                                                    torch_compile=True), state)
    assert full == default_full and full[:3] == [1, 2, 4] and buckets == [] and default_buckets
    assert mixed_graph_sizes(cuda, state)  # small mixed steps keep their FULL graphs


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def test_an_uncompiled_engine_never_imports_dynamo(model_dir: Path) -> None:
    run = _run([sys.executable, "-c", NO_DYNAMO_SCRIPT, str(model_dir)])
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not result["dynamo"] and not result["sympy"], result
    assert all(len(t) == 5 for t in result["tokens"])


def test_precompiled_uncompiled_engine_starts_without_dynamo(tmp_path: Path, model_dir: Path) -> None:
    cache = tmp_path / "cache"
    pre = _run([sys.executable, "-m", "graphrunner", "precompile", "--model", str(model_dir), "--out", str(cache),
                "--max-model-len", "256", "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "64",
                "--compilation-config", json.dumps(UNCOMPILED)])
    assert pre.returncode == 0, pre.stderr
    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    assert manifest["compiled"] is False and not (cache / "model.aot").exists(), manifest
    eager = json.loads(_run([sys.executable, "-c", NO_DYNAMO_SCRIPT, str(model_dir)]).stdout.splitlines()[-1])
    run = _run([sys.executable, "-c", NO_DYNAMO_SCRIPT, str(model_dir), str(cache), json.dumps(UNCOMPILED)])
    assert run.returncode == 0, run.stderr
    warm = json.loads(run.stdout.strip().splitlines()[-1])
    assert warm["tokens"] == eager["tokens"] and not warm["torch_compile"], warm
    assert not warm["dynamo"] and not warm["sympy"], warm
    # a compiled engine is not served from an uncompiled precompile (and the other way round): the field is named
    from graphrunner import LLM

    with pytest.raises(ValueError, match="compiled: cache has False, this run has True"):
        LLM(model=model_dir, compile_cache=cache, num_gpu_blocks_override=64, max_model_len=256, device="cpu",
            dtype="float32")
