"""GPU end-to-end checks (run with `-m gpu` on a CUDA machine; skipped elsewhere).

* A Qwen3-0.6B-shaped bf16 model with random weights against HF transformers: greedy tokens
  equal, or at the first divergence each side's token is in the other's top-5.
* Tiny fp32 models: the Triton prep/sampling path on CUDA gives exactly HF's greedy tokens.
* The step launch never synchronises with the host (torch.cuda.set_sync_debug_mode("error")).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from sync_check import SyncFreeLaunches
from tiny_models import hf_greedy, make_tiny_model, model_state_for

from graphrunner import LLM, SamplingParams
from graphrunner.attention import forward_context
from graphrunner.attention.testing import contiguous_batch
from graphrunner.config import ModelConfig
from graphrunner.loader import load_model
from graphrunner.step_plan import StepMode

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
PROMPT_LENS = [1, 5, 17, 33, 64, 100, 128, 250]


def _prompts(vocab: int = 10000) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The BENCHMARKS.md model: Qwen3-0.6B shape, random weights (seed 0), saved in bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                      architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("qwen3-0.6b")
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


@functools.cache
def _our_model(model_dir: Path) -> torch.nn.Module:
    return load_model(model_dir, model_state_for(model_dir), torch.bfloat16, torch.device("cuda"))


@functools.cache
def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def _our_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Our model's next-token logits after `ids` (one prefill through the real loader) [V] float32."""
    cfg = ModelConfig.from_dir(model_dir)
    model = _our_model(model_dir)
    meta, kv = contiguous_batch([len(ids)], [len(ids)], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16,
                                torch.bfloat16, "cuda")
    with torch.inference_mode(), forward_context(meta, kv):
        hidden = model(torch.tensor(ids, device="cuda"), torch.arange(len(ids), device="cuda"))
        return model.compute_logits(hidden[-1:])[0]


def _hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = _hf_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0, -1].float()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_qwen3_06b_bf16_matches_hf(qwen3_06b_dir: Path, backend: str) -> None:
    prompts = _prompts()
    llm = LLM(model=qwen3_06b_dir, max_model_len=1024, gpu_memory_utilization=0.5, device="cuda",
              attention_backend=backend)
    ours = [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))]
    del llm
    torch.cuda.empty_cache()
    hf = _hf_model(qwen3_06b_dir)
    exact = 0
    for prompt, mine in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=None, attention_mask=torch.ones(1, len(prompt), device="cuda",
                                                                           dtype=torch.long))[0, len(prompt):].tolist()
        if mine == ref:
            exact += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
        prefix = prompt + mine[:k]
        hf_top5 = _hf_logits(qwen3_06b_dir, prefix).topk(5).indices.tolist()
        our_top5 = _our_logits(qwen3_06b_dir, prefix).topk(5).indices.tolist()
        assert mine[k] in hf_top5 and ref[k] in our_top5, (len(prompt), k, mine[k], ref[k], hf_top5, our_top5)
    print(f"{backend}: exact greedy matches: {exact}/{len(prompts)}")


def test_qwen3_06b_bf16_uncompiled_full_graphs_equal_eager(qwen3_06b_dir: Path) -> None:
    """FULL graphs of the uncompiled model (compilation level 0), and the default graphs of eager pieces
    (compilation_config backend "eager"), replay eager's kernels: bf16 greedy tokens are eager's, bit for bit, with
    the decodes (and the short prompts' mixed steps) replayed from graphs."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for name, kw in (("eager", {"enforce_eager": True}),
                     ("uncompiled", {"compilation_config": {"level": 0, "cudagraph_mode": "FULL"}}),
                     ("eager_pieces", {"compilation_config": {"backend": "eager"}})):
        llm = LLM(model=qwen3_06b_dir, max_model_len=1024, gpu_memory_utilization=0.5, device="cuda", **kw)
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name != "eager":
            assert llm.engine.runner.graphs.mode_counts[StepMode.FULL] >= NEW_TOKENS - 2
        del llm
        torch.cuda.empty_cache()
    assert tokens["uncompiled"] == tokens["eager"]
    assert tokens["eager_pieces"] == tokens["eager"]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_tiny_fp32_triton_path_matches_hf(arch: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, arch)
    prompts = _prompts(512)
    expected = [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    for kwargs in ({}, {"max_num_batched_tokens": 40}, {"num_gpu_blocks_override": 30}):
        llm = LLM(model=model_dir, dtype="float32", max_model_len=512, use_triton=True, device="cuda", **kwargs)
        got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in got] == expected, kwargs


def test_step_loop_never_synchronises(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "Qwen3ForCausalLM")
    # small blocks and a small budget: prefill chunks, decodes and preemptions all happen under the check
    llm = LLM(model=model_dir, max_model_len=512, num_gpu_blocks_override=40, max_num_batched_tokens=48,
              block_size=16, device="cuda")
    engine = llm.engine
    launches = SyncFreeLaunches(engine)
    extras = [{}, {"top_k": 5, "top_p": 0.9}, {"min_p": 0.1, "repetition_penalty": 1.2},
              {"presence_penalty": 0.5, "frequency_penalty": 0.3, "logprobs": 3}, {"logit_bias": {5: 2.0}},
              {"allowed_token_ids": list(range(100))}, {"prompt_logprobs": 2, "min_tokens": 4, "stop_token_ids": [9]},
              {"bad_words": ["the quick"]}]
    params = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True, seed=i, **extras[i % len(extras)])
              for i, t in enumerate([0.0, 0.7, 1.0] * 4)]
    outs = llm.generate(_prompts(512)[:8] + _prompts(512)[:4], params)
    assert launches.count > 24 and all(len(o.outputs[0].token_ids) == 24 or o.outputs[0].finish_reason == "stop"
                                 for o in outs)
    assert engine.scheduler.num_preemptions > 0
