"""The sampling suite end to end on tiny fp32 models, against Hugging Face references: top-k/top-p
edge cases equal greedy, penalties equal HF's processors (or the vLLM formula on HF logits),
logprobs and prompt logprobs equal log_softmax of HF's logits, masks and bias hold, seeded
outputs do not depend on the batch, and a request whose logits go NaN ends alone with "error".
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import hf_logits, make_tiny_model

from graphrunner import LLM, SamplingParams

PROMPT = [11, 22, 33, 44, 55, 66, 77]
N = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sampling"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """CPU runs the PyTorch references; CUDA runs the Triton kernels (fp32 on both, against HF fp32 on CPU)."""
    return request.param


@pytest.fixture(scope="module")
def llm(model_dir: Path, device: str) -> LLM:
    return LLM(model=model_dir, num_gpu_blocks_override=512, max_model_len=256, device=device, dtype="float32")


def _one(llm: LLM, **kw: object) -> list[int]:
    params = SamplingParams(max_tokens=N, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return llm.generate([PROMPT], params)[0].outputs[0].token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy(llm: LLM) -> None:
    greedy = _one(llm, temperature=0.0)
    assert _one(llm, temperature=1.0, top_k=1, seed=3) == greedy
    assert _one(llm, temperature=1.5, top_p=1e-6, seed=4) == greedy
    assert _one(llm, temperature=1.0, min_p=1.0, seed=5) == greedy


def test_repetition_penalty_matches_hf(llm: LLM, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    for penalty in (1.3, 0.8):
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                              repetition_penalty=penalty, eos_token_id=None)[0, len(PROMPT):].tolist()
        assert _one(llm, temperature=0.0, repetition_penalty=penalty) == ref


def test_presence_and_frequency_penalties_match_formula_on_hf_logits(llm: LLM, model_dir: Path) -> None:
    pres, freq = 0.7, 0.4
    seq = list(PROMPT)
    for _ in range(N):  # greedy with vLLM's formula applied to HF's logits, one token at a time
        logits = hf_logits(model_dir, seq)[-1].clone()
        out = seq[len(PROMPT):]
        for tok in set(out):
            logits[tok] -= freq * out.count(tok) + pres
        seq.append(int(logits.argmax()))
    assert _one(llm, temperature=0.0, presence_penalty=pres, frequency_penalty=freq) == seq[len(PROMPT):]


def test_logprobs_match_hf_log_softmax(llm: LLM, model_dir: Path) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 8
    ref = torch.log_softmax(hf_logits(model_dir, PROMPT + comp.token_ids), dim=-1)[len(PROMPT) - 1:-1]  # [8, V]
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert entry[tok].rank == 1  # greedy
        assert entry[tok].logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        top = ref[i].topk(5).indices.tolist()
        assert set(entry) == set(top)
        for tid in top:
            assert entry[tid].logprob == pytest.approx(float(ref[i, tid]), abs=1e-4)
        total += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_sampled_token_rank_and_processed_mode(model_dir: Path, device: str) -> None:
    llm = LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=256, logprobs_mode="processed_logprobs",
              device=device, dtype="float32")
    comp = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_k=3, max_tokens=12, ignore_eos=True, seed=1,
                                                 logprobs=0))[0].outputs[0]
    for tok, entry in zip(comp.token_ids, comp.logprobs or []):
        assert list(entry) == [tok] and entry[tok].rank <= 3  # top-k=3 keeps 3 tokens (no ties with random fp32)
        assert entry[tok].logprob > -30  # renormalised over the kept tokens: not -inf, not tiny


def test_prompt_logprobs_match_hf(model_dir: Path, device: str) -> None:
    # a small token budget splits the prompt into chunks: logprobs are assembled across steps
    llm = LLM(model=model_dir, num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=5,
              device=device, dtype="float32")
    prompt = PROMPT + [5, 6, 7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    ref = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry is not None and prompt[p] in entry
        assert entry[prompt[p]].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
        assert set(ref[p - 1].topk(2).indices.tolist()) <= set(entry)


def test_bias_whitelist_and_bad_words(llm: LLM) -> None:
    assert set(_one(llm, temperature=0.0, logit_bias={123: 100.0})) == {123}
    allowed = {5, 17, 300}
    assert set(_one(llm, temperature=1.0, seed=2, allowed_token_ids=sorted(allowed))) <= allowed
    tok = llm.get_tokenizer()
    greedy = llm.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))[0]
    word = tok.decode(greedy.outputs[0].token_ids[2:4]).strip()
    assert word, "need a visible word to ban"
    banned = llm.generate(["The quick brown"], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True,
                                                             bad_words=[word]))[0].outputs[0]
    for variant in (word, " " + word):
        ids = tok.encode(variant, add_special_tokens=False)
        out = banned.token_ids
        assert not any(out[i:i + len(ids)] == ids for i in range(len(out) - len(ids) + 1)), variant


def test_seeded_full_suite_same_alone_and_in_batch_of_32(llm: LLM) -> None:
    rng = random.Random(0)
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.3]), top_k=rng.choice([-1, 5, 50]),
                             top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05]),
                             repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0.0, 0.5]),
                             frequency_penalty=rng.choice([0.0, 0.3]), max_tokens=10, ignore_eos=True, seed=i)
              for i in range(32)]
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(32)]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for i in (0, 13, 31):
        assert llm.generate([prompts[i]], params[i])[0].outputs[0].token_ids == batch[i]


def test_nonfinite_logits_end_only_that_request(tmp_path: Path, device: str) -> None:
    model_dir = make_tiny_model(tmp_path, "LlamaForCausalLM")  # untied: a NaN embedding row reaches one request
    weights = load_file(model_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][7] = float("nan")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(model=model_dir, num_gpu_blocks_override=128, max_model_len=256, device=device, dtype="float32")
    healthy = [[1, 2, 3, 4], [9, 10, 11, 12, 13, 14], [20, 21]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0] for o in llm.generate(healthy, params)]
    mixed = llm.generate(healthy[:1] + [[5, 6, 7, 8]] + healthy[1:], params)
    assert mixed[1].outputs[0].finish_reason == "error" and mixed[1].outputs[0].token_ids == []
    assert [o.outputs[0].token_ids for o in mixed[:1] + mixed[2:]] == [a.token_ids for a in alone]
    assert all(o.outputs[0].finish_reason == "length" for o in mixed[:1] + mixed[2:])
