"""torch.compile traces the model once per engine: one-token steps (batch-1 decodes, the one-token capture)
reuse the general graph instead of making Dynamo trace a one-token variant (issue 17, S1 warm start).

Traces are counted as calls of the piecewise backend (one per Dynamo graph); the pieces run eagerly here, so
the CPU test is fast, and the tokens must equal an uncompiled engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from capture import piecewise
from capture.compiled import manifest_for
from graphrunner import LLM, SamplingParams
from graphrunner.worker import build_model_state

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9]]


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Token counts (dim 0 of the first input) of every graph the piecewise backend is handed."""
    seen: list[int] = []
    original = piecewise.PiecewiseBackend.__call__

    def counting(self: piecewise.PiecewiseBackend, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(example_inputs[0].shape[0])
        return original(self, gm, example_inputs)

    monkeypatch.setattr(piecewise.PiecewiseBackend, "__call__", counting)
    monkeypatch.setattr(piecewise, "_inductor_piece", lambda piece, example_inputs: piece.forward)
    return seen


def _compiled_llm(tmp_path: Path) -> LLM:
    """The demo model compiled on CPU (an engine compiles there only with a compile cache, i.e. a manifest)."""
    plain = LLM(model=None, enforce_eager=True)
    config = plain.engine.config
    manifest_for(config, build_model_state(config)).save(tmp_path)
    return LLM(model=None, compile_cache=str(tmp_path))


def test_one_trace_serves_every_token_count(tmp_path: Path, traces: list[int]) -> None:
    torch._dynamo.reset()
    llm = _compiled_llm(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    got.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
    assert len(traces) == 1, f"Dynamo traced {len(traces)} graphs (token counts {traces}); one-token steps retraced"
    eager = LLM(model=None, enforce_eager=True)
    want = [eager.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    want.append([o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)])
    assert got == want
