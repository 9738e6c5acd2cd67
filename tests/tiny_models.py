"""Tiny random-weight Hugging Face models (Qwen3, Llama, Qwen2, Mistral) with a tiny byte-level BPE tokenizer,
saved to a directory in HF format, plus an HF greedy-generation reference. A helper module for tests,
not a test file: `from tiny_models import make_tiny_model, hf_greedy`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
MISTRAL_WINDOW = 12  # the tiny Mistral's sliding window (tokens), on every layer
TOKENIZER_VOCAB_SIZE = 400  # <= every tiny model's vocab (512)

_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a sentence,
even when its weights are random and its answers make no sense at all. Engines that serve language
models batch many requests together, keep their keys and values in paged blocks of memory, and replay
captured graphs so that the processor is never left waiting for the host.
Once upon a time there was a little river that ran between two hills. Every morning the birds sang
over the water, and every evening the wind carried their songs down to the sea. The people of the
village listened, counted the days, and wrote the numbers 1, 2, 3, 42 and 1000 in their books.
Hello world! How are you today? I am fine, thank you. What is the capital of France? It is Paris.
def add(a, b):
    return a + b
The weather was cold, the tea was warm, and the story was long enough to fill a tiny vocabulary.
"""

_TOKENIZER: Any = None  # the trained PreTrainedTokenizerFast, shared by the whole test session


def tiny_tokenizer() -> Any:
    """A byte-level BPE (vocab <= TOKENIZER_VOCAB_SIZE) with EOS_TOKEN as id 0, trained once per session."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(_TEXT.splitlines(), trainer=trainer)
        _TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    return _TOKENIZER


def _hf_config(arch: str, eos_id: int, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
        "initializer_range": 0.2,  # larger than HF's 0.02: varied greedy output, clear top-1 margins
    }
    if arch == "Qwen3ForCausalLM":
        kwargs = {**common, "num_hidden_layers": 3, "tie_word_embeddings": True, "rope_theta": 1_000_000.0}
        cls = Qwen3Config
    elif arch == "LlamaForCausalLM":
        kwargs = {**common, "tie_word_embeddings": False, "rope_theta": 500_000.0}
        cls = LlamaConfig
    elif arch == "Qwen2ForCausalLM":
        kwargs = {**common, "tie_word_embeddings": False, "rope_theta": 1_000_000.0}
        cls = Qwen2Config
    elif arch == "MistralForCausalLM":  # a window on every layer, shorter than most test prompts
        kwargs = {**common, "tie_word_embeddings": False, "rope_theta": 10_000.0, "sliding_window": MISTRAL_WINDOW}
        cls = MistralConfig
    else:
        raise ValueError(f"no tiny config for {arch!r}")
    kwargs.update(overrides)
    config = cls(**kwargs)
    config.architectures = [arch]
    return config


def llama3_rope_overrides() -> dict[str, Any]:
    """make_tiny_model overrides for a Llama with Llama-3 rope scaling (factors chosen so that all
    three frequency bands — kept, smoothed and divided — occur at head_dim 16)."""
    return {"rope_scaling": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


def make_tiny_model(tmp_dir: Path, arch: str = "Qwen3ForCausalLM", seed: int = 0, *,
                    max_shard_size: str | int | None = None, **config_overrides: Any) -> Path:
    """Save a tiny fp32 random-weight HF model plus tokenizer under tmp_dir and return its directory.

    Qwen3 has tied embeddings (3 layers); Llama, Qwen2 and Mistral are untied (2 layers); Mistral has a
    sliding window of MISTRAL_WINDOW tokens on every layer. `config_overrides`
    go to the HF config class (e.g. **llama3_rope_overrides()); `max_shard_size` (e.g. "100KB")
    produces a sharded checkpoint with model.safetensors.index.json.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = _hf_config(arch, eos_id, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: randomise them so they are tested
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    tag = hashlib.sha1(repr((sorted(config_overrides.items()), max_shard_size)).encode()).hexdigest()[:8]
    out = Path(tmp_dir) / f"{arch}-{seed}-{tag}"
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    return out


def model_state_for(model_dir: Path, **kwargs: Any) -> Any:
    """The registry's ModelState for a saved model directory (what the engine builds once)."""
    from graphrunner.config import ModelConfig
    from model_states import get_model_state

    cfg = ModelConfig.from_dir(model_dir)
    return get_model_state(cfg.architecture)(cfg, **kwargs)


def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """HF fp32 logits [len(token_ids), vocab] of one sequence (no padding, positions 0..n-1)."""
    model = _load_hf(model_dir)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation (fp32, exactly max_new_tokens tokens; EOS neither stops nor is suppressed).

    transformers 5.x: `eos_token_id=None` as a generate() kwarg overrides generation_config.json
    (a GenerationConfig object passed whole would be merged with it and stop at EOS); min_new_tokens
    is deliberately not used, since it masks EOS logits and would change greedy choices.
    """
    model = _load_hf(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
        )
    new_tokens = out[0, len(prompt_ids):].tolist()
    if len(new_tokens) != max_new_tokens:
        raise RuntimeError(f"HF generate stopped after {len(new_tokens)} of {max_new_tokens} tokens")
    return new_tokens


_HF_MODELS: dict[str, Any] = {}


def _load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    config_file = Path(model_dir).resolve() / "config.json"
    key = f"{config_file}:{config_file.stat().st_mtime_ns}"  # a re-saved directory is reloaded
    if key not in _HF_MODELS:
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_MODELS[key]


def greedy_tokens_off_and_on(monkeypatch: Any, module: Any, switch: str, model_dir: Path,
                             prompts: list[list[int]], max_tokens: int, **llm_kwargs: Any) -> list[list[list[int]]]:
    """Greedy token ids of the prompts from a fresh engine with module.<switch> False, then True (a GPU A/B of a
    kernel switch read at launch time): [off, on], each [prompt][token]."""
    from graphrunner import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = []
    for on in (False, True):
        monkeypatch.setattr(module, switch, on)
        llm = LLM(model=model_dir, **llm_kwargs)
        tokens.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
        del llm
    return tokens


def attention_with_switch(switch: str, monkeypatch: Any, on: bool, query: torch.Tensor, cache: torch.Tensor,
                          meta: Any, num_splits: int, window: int | None) -> torch.Tensor:
    """Triton paged attention of query [T, Hq, D] over one layer's cache with triton_attention.<switch> set to `on`
    (a kernel switch read at launch time), into a fresh output."""
    from graphrunner.attention import triton_attention

    monkeypatch.setattr(triton_attention, switch, on)
    return triton_attention.unified_attention(query, cache, meta, query.shape[-1] ** -0.5, sliding_window=window,
                                              num_splits=num_splits, out=torch.empty_like(query))
