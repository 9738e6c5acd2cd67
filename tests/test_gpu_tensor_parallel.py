"""Tensor parallelism on two GPUs (NCCL), with torch.compile and CUDA graphs (FULL and PIECEWISE) as by default:
TP=2 gives TP=1's tokens (greedy and seeded), the collectives replay inside the graphs, rank 0's step launch never
synchronises with the device, and a killed worker ends the engine with an error instead of a hang.

Run with `-m gpu` on a machine with at least 2 GPUs; skipped elsewhere.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sync_check import SyncFreeLaunches
from tiny_models import make_tiny_model

from graphrunner import LLM, SamplingParams, parallel_state
from graphrunner.engine import StepFailed
from graphrunner.step_plan import StepMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

NEW_TOKENS = 32
ARCHS = {"qwen3": ("Qwen3ForCausalLM", {"vocab_size": 509}), "llama-1-kv": ("LlamaForCausalLM",
         {"num_key_value_heads": 1}), "qwen2": ("Qwen2ForCausalLM", {})}
ENGINE: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 16, "device": "cuda"}


def _prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(400) for _ in range(n)]} for n in (1, 5, 17, 33, 64, 100, 130, 250)]


def _plain() -> list[SamplingParams]:
    """Greedy and temperature-only: FULL graphs, each rank sampling its vocabulary shard."""
    return [SamplingParams(temperature=[0.0, 0.8][i % 2], max_tokens=NEW_TOKENS, ignore_eos=True, seed=i)
            for i in range(8)]


def _filtered() -> list[SamplingParams]:
    """top-p and logprobs: PIECEWISE decodes with the logits gathered."""
    return [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, ignore_eos=True, seed=i, logprobs=2)
            for i in range(8)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for params in (_plain(), _filtered())
            for o in llm.generate(_prompts(), params, use_tqdm=False)]


MODES: dict[str, dict[str, Any]] = {"graphs": {}, "eager": {"enforce_eager": True},
                                    "piecewise": {"cudagraph_mode": "piecewise"},
                                    "chunked": {"max_num_batched_tokens": 40}}
_EXPECTED: dict[str, tuple[str, list[list[int]]]] = {}  # arch -> (model dir, TP=1 tokens): one TP=1 run per arch


def _model_and_expected(arch: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    if arch not in _EXPECTED:
        name, overrides = ARCHS[arch]
        model_dir = str(make_tiny_model(tmp_path_factory.mktemp(arch), name, **overrides))
        llm = LLM(model=model_dir, **ENGINE)
        _EXPECTED[arch] = (model_dir, _tokens(llm))
        del llm  # its KV cache must not stay on GPU 0 beside the TP=2 engines' (they size theirs from free memory)
        gc.collect()
        torch.cuda.empty_cache()
    return _EXPECTED[arch]


# one engine per test (arch x mode), so a log shows which one stalls and a run can pick a few with -k
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_two_gpus_give_one_gpus_tokens(arch: str, mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir, expected = _model_and_expected(arch, tmp_path_factory)
    llm = LLM(model=model_dir, tensor_parallel_size=2, **ENGINE, **MODES[mode])
    try:
        assert _tokens(llm) == expected, mode
        graphs = llm.engine.runner.graphs
        if mode == "graphs":  # the default: decodes replayed FULL graphs (all-reduces and the logits gather inside)
            assert graphs.mode_counts[StepMode.FULL] > 0 and graphs.mode_counts[StepMode.PIECEWISE] > 0
    finally:
        llm.engine.shutdown()


def test_symmetric_memory_all_reduce_gives_one_gpus_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """GRAPHRUNNER_TP_ALLREDUCE=symm_mem: small all-reduces take the one-shot symmetric-memory kernel (inside the
    FULL and piecewise graphs too), large ones NCCL; with two ranks the sums are the same additions, so the tokens
    equal TP=1's (chunked prefill on). torch keeps the group's symmetric-memory state for the life of the process:
    a second symm_mem engine here is refused with an error (its rendezvous once hung)."""
    monkeypatch.setenv("GRAPHRUNNER_TP_ALLREDUCE", "symm_mem")  # (the spawned worker inherits it)
    model_dir, expected = _model_and_expected("qwen3", tmp_path_factory)
    llm = LLM(model=model_dir, tensor_parallel_size=2, **ENGINE, **MODES["chunked"])
    try:
        assert parallel_state._SYMM is not None  # rank 0 (this process) set the buffer up
        assert _tokens(llm) == expected
    finally:
        llm.engine.shutdown()
    with pytest.raises(RuntimeError, match="symm_mem serves only the first tensor-parallel engine"):
        LLM(model=model_dir, tensor_parallel_size=2, **ENGINE)


def test_rank0_step_launch_never_synchronises(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    llm = LLM(model=model_dir, tensor_parallel_size=2, max_model_len=512, num_gpu_blocks_override=40,
              max_num_batched_tokens=48, block_size=16, device="cuda")
    try:
        engine = llm.engine
        launches = SyncFreeLaunches(engine)
        params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=i, logprobs=2 if i % 3 else None)
                  for i, t in enumerate([0.0, 0.7, 1.0] * 4)]
        outs = llm.generate(_prompts()[:8] + _prompts()[:4], params, use_tqdm=False)
        assert launches.count > 24 and all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_a_killed_gpu_worker_ends_the_engine_without_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHRUNNER_TP_TIMEOUT_S", "60")
    model_dir = make_tiny_model(tmp_path, "Qwen2ForCausalLM")
    llm = LLM(model=model_dir, tensor_parallel_size=2, max_model_len=512, device="cuda")
    try:
        engine = llm.engine
        engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(3):
            engine.step()
        (pid,) = engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StepFailed, match=r"worker rank 1 .* exited with code -9"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 45
    finally:
        llm.engine.shutdown()
