"""GraphPiece's control flow on CPU, with CUDA-graph capture replaced by a recorder that replays by
re-running the piece on the captured argument tensors and writing into the captured outputs (what a
CUDA graph does): replay per size, fall-back when an input moved, calls at sizes never captured.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_leaves

from capture import cuda_piece
from capture.cuda_piece import GraphPiece, piecewise_graphs


class _Recorded:
    def __init__(self, fn: Any, args: tuple[Any, ...], out: Any) -> None:
        self.fn, self.args, self.out = fn, args, out
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for dst, src in zip(tree_leaves(self.out), tree_leaves(self.fn(*self.args))):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


@pytest.fixture(autouse=True)
def recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    def record(fn: Any, args: tuple[Any, ...], pool: Any) -> tuple[Any, Any]:
        out = fn(*args)
        return _Recorded(fn, args, out), out

    monkeypatch.setattr(cuda_piece, "_record", record)


def _piece() -> GraphPiece:
    # a compiled piece's shape: tensors in (activations, a weight, a host scalar), a tuple out
    return GraphPiece(lambda x, w, eps: (x @ w + eps, x.sum(-1)), "submod_0")


def test_replays_read_the_captured_buffers_and_write_the_captured_outputs() -> None:
    buf, w = torch.zeros(8, 3), torch.randn(3, 2)
    piece = _piece()
    with piecewise_graphs(4, pool=None, capture=True):
        captured = piece(buf[:4], w, torch.tensor(0.5))
    buf[:4] = torch.randn(4, 3)
    with piecewise_graphs(4, pool=None):
        out = piece(buf[:4], w, torch.tensor(0.5))  # a fresh host scalar each call, as Dynamo passes it
    assert out[0].data_ptr() == captured[0].data_ptr()  # the captured output buffers, rewritten
    torch.testing.assert_close(out[0], buf[:4] @ w + 0.5)
    torch.testing.assert_close(out[1], buf[:4].sum(-1))
    assert piece.graphs[4].graph.replays == 1 and piece.moved_input_calls == 0


def test_moved_input_runs_the_piece_instead_of_a_stale_replay() -> None:
    buf, w = torch.zeros(8, 3), torch.randn(3, 2)
    piece = _piece()
    with piecewise_graphs(4, pool=None, capture=True):
        piece(buf[:4], w, torch.tensor(0.0))
    elsewhere = torch.randn(4, 3)
    with piecewise_graphs(4, pool=None):
        out = piece(elsewhere, w, torch.tensor(0.0))
    torch.testing.assert_close(out[0], elsewhere @ w)
    assert piece.moved_input_calls == 1 and piece.graphs[4].graph.replays == 0


def test_sizes_without_a_graph_and_calls_outside_piecewise_mode() -> None:
    buf, w = torch.randn(8, 3), torch.randn(3, 2)
    piece = _piece()
    with piecewise_graphs(8, pool=None, capture=True):
        piece(buf, w, torch.tensor(0.0))
    with piecewise_graphs(2, pool=None):
        out = piece(buf[:2], w, torch.tensor(0.0))
    torch.testing.assert_close(out[0], buf[:2] @ w)
    assert piece.uncaptured_calls == 1 and set(piece.graphs) == {8}
    torch.testing.assert_close(piece(buf[:3], w, torch.tensor(1.0))[0], buf[:3] @ w + 1.0)  # no mode: plain call
    assert piece.uncaptured_calls == 1


def test_engine_through_recorded_graphs_matches_eager(tmp_path: Any) -> None:
    """The whole capture flow on CPU: pieces split at attention, every size captured largest first,
    FULL decodes padded to captured sizes, PIECEWISE steps padded to token buckets; the tokens equal
    the eager engine's and no replay ever finds an input away from its captured address."""
    from tiny_models import make_tiny_model

    from capture.compiled import compile_model
    from capture.manager import CaptureManager
    from capture.piecewise import PiecewiseBackend
    from graphrunner import LLM, SamplingParams
    from graphrunner.step_plan import StepMode

    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 64, "max_model_len": 128, "attention_backend": "triton",
                              "max_num_seqs": 8, "max_num_batched_tokens": 48}
    prompts = [[(7 * i + j) % 400 for j in range(n)] for i, n in enumerate([3, 17, 40, 5, 26, 9])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, params)]
    # seeded sampling: plain temperature batches run FULL, top-k / penalties force PIECEWISE
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True) for i in range(4)]
    mixed = sampled + [SamplingParams(temperature=0.9, seed=9, top_k=5, max_tokens=8, ignore_eos=True),
                       SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=8, ignore_eos=True)]
    expected_sampled = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts[:4], sampled)]
    expected_mixed = [o.outputs[0].token_ids for o in LLM(model=model_dir, **kwargs).generate(prompts, mixed)]

    llm = LLM(model=model_dir, **kwargs)
    runner = llm.engine.runner
    backend = PiecewiseBackend(compile_piece=lambda piece, example_inputs: piece)  # no Inductor: fast on CPU
    runner.model = compile_model(runner.model, backend)
    manager = CaptureManager(runner.model_state, runner.buffers, backend.graph_pieces, [1, 2, 4, 8],
                             [1, 2, 4, 8, 16, 32], runner.max_model_len)
    manager.capture(runner.capture_bodies(), progress=False)
    runner.graphs = manager
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    full_before = manager.mode_counts[StepMode.FULL]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:4], sampled)] == expected_sampled
    assert manager.mode_counts[StepMode.FULL] > full_before
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, mixed)] == expected_mixed
    assert manager.mode_counts[StepMode.FULL] > 0 and manager.mode_counts[StepMode.PIECEWISE] > 0
    assert manager.mode_counts[StepMode.EAGER] > 0  # a 48-token chunk is above the largest bucket
    assert sum(len(p.graphs) for p in backend.graph_pieces) > 0
    assert not any(p.moved_input_calls or p.uncaptured_calls for p in backend.graph_pieces)
