"""The piecewise backend on CPU: the graph splits at each layer's attention op, the compute pieces
compile with Inductor (C++ on CPU), and outputs equal the eager model across steps of different shapes.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model, model_state_for
from torch._dynamo.utils import counters

from capture.compiled import compile_model
from capture.piecewise import PiecewiseBackend, piece_key
from graphrunner.attention import forward_context
from graphrunner.attention.testing import contiguous_batch
from graphrunner.config import ModelConfig
from graphrunner.loader import load_model


def _run(fn: object, cfg: ModelConfig, lens: list[int]) -> torch.Tensor:
    ids = (torch.arange(sum(lens)) * 7) % cfg.vocab_size
    pos = torch.cat([torch.arange(n) for n in lens])
    meta, kv = contiguous_batch(lens, lens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32, "cpu")
    with torch.inference_mode(), forward_context(meta, kv):
        return fn(ids, pos)  # type: ignore[operator]


def test_piecewise_split_and_compiled_pieces_match_eager(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, model_state_for(model_dir), torch.float32, torch.device("cpu"))
    backend = PiecewiseBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    counters.clear()
    for lens in ([5, 3], [1, 1, 7], [2]):
        torch.testing.assert_close(_run(compiled, cfg, lens), _run(model, cfg, lens), atol=1e-5, rtol=1e-5)
    assert len(backend.attention_pieces) == cfg.num_layers
    assert len(backend.pieces) == cfg.num_layers + 1  # before the first, between each pair, after the last
    inductor = counters["inductor"]
    assert inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_hit"] >= backend.compiled_pieces, dict(inductor)
    assert counters["stats"]["unique_graphs"] == 1, "one symbolic graph serves every step shape"


def test_split_keeps_every_attention_call_alone() -> None:
    seen: list[int] = []

    def record(piece: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(sum(1 for n in piece.graph.nodes if n.op == "call_function"))
        assert not any("paged_attention" in str(n.target) for n in piece.graph.nodes if n.op == "call_function")
        return piece

    backend = PiecewiseBackend(compile_piece=record)

    def f(x: torch.Tensor) -> torch.Tensor:
        q = x * 2
        a = torch.empty_like(q)
        torch.ops.graphrunner.paged_attention(q, q, q, a, 0, 1, 1, 4, 1.0, -1)
        b = torch.empty_like(a)
        torch.ops.graphrunner.paged_attention(a + 1, a, a, b, 1, 1, 1, 4, 1.0, -1)
        return b - 3

    graph = torch.fx.symbolic_trace(f)
    backend(graph, [torch.zeros(2, 4)])
    assert len(backend.attention_pieces) == 2 and len(seen) == 3


def test_step_buffer_views_trace_one_variant_without_lifted_floats(tmp_path: Path) -> None:
    """The runner passes views of its step buffers, and its first (profiling) step spans a whole buffer.
    `compile_model` must then make exactly one variant for every token count: none from duck-sizing a view
    with its base, none specialised to one token, and no float attribute lifted into a 0-d input."""
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, model_state_for(model_dir), torch.float32, torch.device("cpu"))
    inputs_seen: list[list[object]] = []

    def record(piece: torch.fx.GraphModule, example_inputs: list) -> object:
        inputs_seen.append(list(example_inputs))
        return piece

    torch._dynamo.reset()
    compiled = compile_model(model, PiecewiseBackend(compile_piece=record))
    counters.clear()
    ids_buf = torch.zeros(24, dtype=torch.int64)  # [T_max] int64, like the runner's step buffers
    pos_buf = torch.zeros(24, dtype=torch.int64)
    for lens in ([24], [5, 2], [1], [3], [1, 1, 1]):
        n = sum(lens)
        ids_buf[:n] = (torch.arange(n) * 7) % cfg.vocab_size
        pos_buf[:n] = torch.cat([torch.arange(k) for k in lens])
        meta, kv = contiguous_batch(lens, lens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32,
                                    "cpu")
        with torch.inference_mode():
            with forward_context(meta, kv):
                got = compiled(ids_buf[:n], pos_buf[:n])
            with forward_context(meta, kv):
                want = model(ids_buf[:n].clone(), pos_buf[:n].clone())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    scalars = [a for inputs in inputs_seen for a in inputs if isinstance(a, torch.Tensor) and a.dim() == 0]
    assert not scalars, f"{len(scalars)} 0-d inputs reached the pieces: float attributes were lifted"


def test_equal_pieces_compile_once_and_still_match_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5-layer model has 6 compute pieces: the first, four equal middle ones (one layer's tail and the next
    one's head, differing only in their weights' names) and the last. Each distinct piece compiles once; the
    shared compiled code gives the eager model's outputs, and with reuse off every piece compiles."""
    # Inductor's and AOTAutograd's on-disk caches are shared by the whole process: a piece an earlier test
    # compiled without compile_model's size-oblivious setting came back with its `2 <= tokens` guard, and the
    # one-token batch below recompiled the model (6 compiles instead of 3). This test counts our reuse alone.
    import torch._functorch.config as functorch_config

    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", num_hidden_layers=5)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, model_state_for(model_dir), torch.float32, torch.device("cpu"))
    for reuse, want_compiles in ((True, 3), (False, 6)):
        calls: list[torch.fx.GraphModule] = []

        def inductor(piece: torch.fx.GraphModule, example_inputs: list, calls: list = calls) -> object:
            from torch._inductor.compile_fx import compile_fx

            calls.append(piece)
            return compile_fx(piece, example_inputs)

        torch._dynamo.reset()
        backend = PiecewiseBackend(compile_piece=inductor, reuse=reuse)
        compiled = compile_model(model, backend)
        for lens in ([5, 3], [1], [2, 1, 4]):
            # inductor fuses and reorders fp32 reductions: CI saw one of 512 elements off by 1.3e-5
            torch.testing.assert_close(_run(compiled, cfg, lens), _run(model, cfg, lens), atol=1e-4, rtol=1e-4)
        assert len(backend.pieces) == cfg.num_layers + 1 == 6
        assert len(calls) == backend.compiled_pieces == want_compiles, (reuse, len(calls))
    torch._dynamo.reset()


def test_piece_key_sees_structure_constants_and_inputs_not_names() -> None:
    def traced(fn: object, *names: str) -> torch.fx.GraphModule:
        gm = torch.fx.symbolic_trace(fn)
        for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names, strict=False):
            node.name = name  # (what differs between two layers' pieces: their inputs' names)
        gm.recompile()
        return gm

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w) * 0.5

    def g(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w) * 0.25  # another constant

    def h(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(w, x) * 0.5  # the same ops, arguments swapped

    class WithAttr(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    x, w = torch.zeros(2, 3), torch.zeros(4, 3)
    key = piece_key(traced(f, "a", "layer_0_w"), [x, w])
    assert key is not None and key == piece_key(traced(f, "b", "layer_7_w"), [x, w])
    assert key != piece_key(traced(g), [x, w])
    assert key != piece_key(traced(h), [x, w])
    assert key != piece_key(traced(f), [torch.zeros(2, 3, dtype=torch.float64), w])  # input dtype
    assert key != piece_key(traced(f), [x, torch.zeros(5, 3)])  # input shape
    assert key != piece_key(traced(f), [x, torch.zeros(3, 4).t()])  # input strides
    assert piece_key(torch.fx.symbolic_trace(WithAttr()), [x]) is None  # reads a module attribute: never shared
    const = torch.fx.symbolic_trace(f)
    mul = next(n for n in const.graph.nodes if n.target is operator.mul)
    mul.args = (mul.args[0], torch.ones(3))  # a tensor literal in the arguments: never shared either
    assert piece_key(const, [x, w]) is None
