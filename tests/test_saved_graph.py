"""The eager piece compiler (compilation_config backend "eager") and its warm start without Dynamo: precompile saves
the split graph as data (capture/saved_graph.py), and a warm start rebuilds it, imports neither Dynamo, Inductor nor
sympy, and generates eager's tokens; a stale or unreadable file means tracing again (the same tokens). Units: the
format round-trips a traced graph, refuses what it cannot name, and op nodes call their implementations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model
from torch import fx, nn

from capture import saved_graph
from capture.compile_settings import configure_compilers
from capture.manifest import MANIFEST_NAME
from capture.piecewise import PiecewiseBackend, call_implementations
from graphrunner import LLM, SamplingParams
from graphrunner.config import DEFAULT_COMPILE_BACKEND
from graphrunner.engine_args import build_engine_config
from graphrunner.models.norm import _add_rms_norm, add_rms_norm_ref

EAGER_PIECES = {"backend": "eager"}
PROMPTS = [[5, 6, 7, 8, 9], [3], list(range(40, 70))] + [[i + 1] * (i + 2) for i in range(9)]  # > 8 prefills
WARM_SCRIPT = """
import json, sys
from graphrunner import LLM, SamplingParams
from graphrunner.config import DEFAULT_COMPILE_BACKEND
llm = LLM(model=sys.argv[1], compile_cache=sys.argv[2], num_gpu_blocks_override=64, max_model_len=256,
          device=sys.argv[3], dtype="float32", compilation_config={"backend": "eager"})
out = llm.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
graphs = llm.engine.runner.graphs
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "model": type(llm.engine.runner.model).__name__,
                  "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
                  "sympy": "sympy" in sys.modules,
                  "modes": {str(k): v for k, v in graphs.mode_counts.items()} if graphs is not None else {},
                  "moved": sum(p.moved_input_calls + p.uncaptured_calls for p in graphs.pieces or [])
                  if graphs is not None else 0}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("saved_graph"), "Qwen3ForCausalLM")


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                                 ignore_eos=True))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_precompile_then_warm_start_without_dynamo(tmp_path: Path, model_dir: Path, device: str) -> None:
    cache = tmp_path / "cache"
    pre = subprocess.run([sys.executable, "-m", "graphrunner", "precompile", "--model", str(model_dir), "--out",
                          str(cache), "--max-model-len", "256", "--device", device, "--dtype", "float32",
                          "--num-gpu-blocks-override", "64", "--compilation-config", json.dumps(EAGER_PIECES)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert pre.returncode == 0, pre.stderr
    manifest = json.loads((cache / MANIFEST_NAME).read_text())
    assert manifest["compile_backend"] == "eager" and manifest["compiled"], manifest
    assert (cache / saved_graph.GRAPH_FILE).is_file() and not (cache / "model.aot").exists()
    expected = _greedy(LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=256, device=device,
                           dtype="float32", enforce_eager=True))

    def warm(**env: str) -> dict:
        run = subprocess.run([sys.executable, "-c", WARM_SCRIPT, str(model_dir), str(cache), device,
                              json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600, check=False,
                             env={**os.environ, **env})
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["tokens"] == expected
        return result

    loaded = warm()
    assert loaded["model"] == "SavedGraphModel", loaded
    assert not (loaded["dynamo"] or loaded["inductor"] or loaded["sympy"]), loaded
    if device == "cuda":  # decodes replay FULL graphs, the first step's ten prefills the rebuilt pieces' graphs
        assert loaded["modes"].get("StepMode.PIECEWISE", 0) >= 1 and loaded["modes"].get("StepMode.FULL", 0) >= 4
        assert loaded["moved"] == 0, loaded
    # traced with another switch (another graph, which nothing in the file could tell): traced again through Dynamo
    other = warm(GRAPHRUNNER_FUSED_QKV_PREP="0")
    assert other["model"] == "UnfusedTrace" and other["dynamo"], other
    if device == "cpu":  # asked to trace again (GRAPHRUNNER_AOT=0, as for model.aot); a file that does not load
        assert warm(GRAPHRUNNER_AOT="0")["model"] == "UnfusedTrace"  # is not used either
        (cache / saved_graph.GRAPH_FILE).write_bytes(b"not a saved graph")
        assert warm()["model"] == "UnfusedTrace"


def test_an_inductor_precompile_does_not_serve_eager_pieces(tmp_path: Path, model_dir: Path) -> None:
    from capture.compiled import manifest_for
    from graphrunner.worker import build_model_state

    config = build_engine_config(model=model_dir, device="cpu", max_model_len=256, dtype="float32",
                                 compilation_config={"backend": "inductor"})
    manifest_for(config, build_model_state(config)).save(tmp_path)
    with pytest.raises(ValueError, match="compile_backend: cache has 'inductor', this run has 'eager'"):
        LLM(model=model_dir, compile_cache=tmp_path, max_model_len=256, dtype="float32", device="cpu",
            num_gpu_blocks_override=16, compilation_config=EAGER_PIECES)


@pytest.mark.parametrize(("cc", "match"), [({"backend": "tvm"}, "backend 'tvm': expected one of"),
                                           ({"backend": 0}, "backend 0: expected one of"),
                                           ({"backend": ["eager"]}, r"backend \['eager'\]: expected one of"),
                                           ({"level": 0, "backend": "eager"}, "level 0 .* with backend 'eager'")])
def test_bad_backends_are_refused(model_dir: Path, cc: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_engine_config(model=model_dir, device="cpu", compilation_config=cc)
    for unset in ("", None):  # vLLM's "" is the default backend
        assert build_engine_config(model=model_dir, device="cpu",
                                   compilation_config={"backend": unset}).compile_backend == DEFAULT_COMPILE_BACKEND
    with pytest.raises(ValueError, match="piece compiler must be one of"):
        PiecewiseBackend.named("tvm")


class _Toy(nn.Module):
    """A forward of the engine's signature with weights, a buffer, a size and an op of ours."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.Parameter(torch.rand(6) + 0.5)
        self.register_buffer("scale", torch.arange(6, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * positions[:, None].float()
        if torch.compiler.is_compiling():
            normed, summed = torch.ops.graphrunner.add_rms_norm(h, h * self.scale, self.norm, 1e-6)
        else:
            normed, summed = add_rms_norm_ref(h, h * self.scale, self.norm, 1e-6)
        return (normed + summed).reshape(input_ids.shape[0], 2, 3).sum(-1)


def _record(model: nn.Module, *args: torch.Tensor) -> saved_graph._Recorder:
    configure_compilers()  # (as saved_graph.save does: floats specialised, not graph inputs)
    recorder = saved_graph._Recorder(model)
    torch.compile(model, backend=recorder, fullgraph=True, dynamic=True)(*args)
    return recorder


def test_the_format_round_trips_a_traced_graph(tmp_path: Path) -> None:
    torch.manual_seed(0)
    toy = _Toy().eval().requires_grad_(False)
    ids, pos = torch.tensor([1, 5, 10, 2, 3]), torch.tensor([0, 1, 2, 3, 4])
    recorder = _record(toy, ids, pos)
    assert recorder.data is not None, recorder.why
    (tmp_path / saved_graph.GRAPH_FILE).write_bytes(recorder.data)
    loaded = saved_graph.load(tmp_path, toy)
    assert loaded is not None
    model, pieces = loaded
    assert pieces.compiled_pieces == len(pieces.graph_pieces) == 1  # no attention: one compute piece
    kinds = {b.kind for b, _ in model._binds}
    assert kinds == {"state", "arg", "size"}, model._binds
    for n in (5, 1, 8):  # other token counts than the trace's: the sizes are bound from the arguments
        ids, pos = torch.randint(0, 11, (n,)), torch.arange(n)
        with torch.no_grad():
            assert torch.equal(model(ids, pos), toy(ids, pos))
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(ids, pos, inputs_embeds=torch.zeros(n, 6))


def test_what_the_format_cannot_name_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Extra(_Toy):  # a third argument: nothing at warm start would know what to pass
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids, positions) + extra

    recorder = _record(Extra().eval().requires_grad_(False), torch.tensor([1, 2]), torch.tensor([0, 1]),
                       torch.ones(2, 2))
    assert recorder.data is None and "L['extra']" in recorder.why
    graph = fx.Graph()
    graph.output(graph.get_attr("table"))
    with pytest.raises(saved_graph.Unsaveable, match="module attribute"):
        saved_graph.graph_nodes(fx.GraphModule({"table": torch.zeros(2)}, graph))

    def local(x: torch.Tensor) -> torch.Tensor:  # not importable by name
        return x

    graph = fx.Graph()
    graph.output(graph.call_function(local, (graph.placeholder("x"),)))
    with pytest.raises(saved_graph.Unsaveable, match="does not resolve back"):
        saved_graph.graph_nodes(fx.GraphModule({}, graph))
    (tmp_path / saved_graph.GRAPH_FILE).write_bytes(b"\x80\x04junk")
    assert saved_graph.load(tmp_path, _Toy()) is None and "unreadable" in caplog.text


def test_op_nodes_call_their_implementations() -> None:
    graph = fx.Graph()
    x, r, w = (graph.placeholder(n) for n in ("x", "r", "w"))
    graph.output(graph.call_function(torch.ops.graphrunner.add_rms_norm.default, (x, r, w, 1e-6)))
    gm = call_implementations(fx.GraphModule({}, graph))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [_add_rms_norm]
    args = (torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5)
    for got, want in zip(gm(*args), add_rms_norm_ref(*args, 1e-6), strict=True):
        torch.testing.assert_close(got, want)


def test_manifests_written_before_eager_pieces_read_as_inductor(tmp_path: Path, model_dir: Path) -> None:
    from capture.manifest import Manifest

    Manifest.current(model_dir, torch.float32, torch.device("cpu"), ()).save(tmp_path)  # (the default backend)
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert raw.pop("compile_backend") == DEFAULT_COMPILE_BACKEND
    for compiled, backend in ((True, "inductor"), (False, "")):
        (tmp_path / MANIFEST_NAME).write_text(json.dumps({**raw, "compiled": compiled}))
        assert Manifest.load(tmp_path).compile_backend == backend


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_other_architectures_warm_start_from_their_saved_graph(tmp_path: Path, arch: str) -> None:
    """Untied heads, q/k/v biases, a sliding window: each precompiles for eager pieces, and an engine built from the
    directory runs the rebuilt graph (in this process, so Dynamo is around: the fresh-process test above checks
    that a warm start never imports it) with eager's sampled tokens."""
    from graphrunner.precompile import precompile

    model_dir = make_tiny_model(tmp_path / "model", arch)
    kw = {"num_gpu_blocks_override": 64, "max_model_len": 256, "device": "cpu", "dtype": "float32"}
    config = build_engine_config(model=model_dir, compilation_config=EAGER_PIECES, **kw)
    precompile(config, tmp_path / "cache")
    assert (tmp_path / "cache" / saved_graph.GRAPH_FILE).is_file()
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True) for i in range(len(PROMPTS))]
    eager = LLM(model=model_dir, enforce_eager=True, **kw)
    warm = LLM(model=model_dir, compile_cache=tmp_path / "cache", compilation_config=EAGER_PIECES, **kw)
    assert type(warm.engine.runner.model).__name__ == "SavedGraphModel"
    assert [o.outputs[0].token_ids for o in warm.generate(PROMPTS, params)] == \
        [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
