"""Frozen configuration dataclasses: model, cache, scheduler and engine.

`ModelConfig.from_hf()` is the one place that knows the fallbacks between Hugging Face config
spellings (old `rope_theta`/`rope_scaling` vs new `rope_parameters`, missing `head_dim`, ...).
Every dataclass validates itself in `__post_init__` with messages that name the bad field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphrunner.spec_config import SpeculativeConfig

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a dtype name ("auto", "bfloat16", ...) to a torch dtype; auto = bf16 on GPU, fp32 on CPU."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; use one of {sorted(set(_DTYPES))}")
        return name
    if not isinstance(name, str):
        raise TypeError(f"dtype must be a string or torch.dtype, got {type(name).__name__}")
    key = name.lower().removeprefix("torch.")
    if key == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is 'default' or 'llama3'."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: 'default', 'llama3'")
        if not self.theta > 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only model, read from an HF config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # the parsed config.json, for the few fields one architecture's ModelState reads (Llama's mlp_bias,
    # Qwen's layer_types); not part of equality: two configs with the same hyper-parameters are equal
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu' is implemented")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a config.json dict, applying every HF fallback in one place.

        Every field read is type-checked first: a missing required field or a field of the wrong type
        raises ValueError naming `source` (the file) and the field.
        """
        fields = _check_hf(hf, source)
        rope_fields = _rope_fields(hf, source)
        try:
            return cls(**fields, rope=RopeConfig(**rope_fields), hf=dict(hf))
        except ValueError as exc:  # the dataclasses' own checks: add the file
            raise ValueError(f"{source}: {exc}") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read and check `model_dir`/config.json; ValueError naming the file on any problem."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, absurdly nested
            raise ValueError(f"{path} is not a readable JSON file: {exc}") from exc
        return cls.from_hf(hf, source=str(path))


_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor")
_JSON_NAMES: dict[type, str] = {bool: "boolean", str: "string", dict: "object", list: "array"}


def _bad_field(source: str, name: str, want: str, value: Any) -> ValueError:
    return ValueError(f"{source}: field {name!r} must be {want}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(hf: dict[str, Any], name: str, source: str, default: int | None = None, minimum: int = 1) -> int | None:
    """hf[name] as an int >= minimum; `default` when absent or null."""
    value = hf.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < minimum:
        raise _bad_field(source, name, "a positive integer" if minimum == 1 else f"an integer >= {minimum}", value)
    return value


def _number_field(hf: dict[str, Any], name: str, source: str, default: float) -> float:
    """hf[name] as a finite number > 0; `default` when absent or null."""
    value = hf.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise _bad_field(source, name, "a finite number > 0", value)
    return float(value)


def _typed_field(hf: dict[str, Any], name: str, source: str, kind: type, default: Any) -> Any:
    """hf[name] when it is a `kind` (bool, str, dict, list), `default` when absent or null."""
    value = hf.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise _bad_field(source, name, f"a JSON {_JSON_NAMES[kind]}", value)
    return value


def _check_hf(hf: Any, source: str) -> dict[str, Any]:
    """The ModelConfig fields (all but rope and hf) from a parsed config.json, every one type-checked."""
    if not isinstance(hf, dict):
        raise ValueError(f"{source} must contain a JSON object, got {type(hf).__name__}")
    missing = [name for name in (*_REQUIRED_INTS, "architectures") if hf.get(name) is None]
    if missing:
        raise ValueError(f"{source} lacks required field(s) {', '.join(map(repr, missing))}")
    ints = {name: _int_field(hf, name, source) for name in _REQUIRED_INTS}
    archs = hf["architectures"]
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
        raise _bad_field(source, "architectures", "a non-empty list of architecture names", archs)
    heads = ints["num_attention_heads"]
    kv_heads = _int_field(hf, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    layer_types = _typed_field(hf, "layer_types", source, list, None)
    if layer_types is not None and (len(layer_types) != ints["num_hidden_layers"]
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise _bad_field(source, "layer_types", f"a list of {ints['num_hidden_layers']} strings (one per layer)",
                         layer_types)
    _int_field(hf, "max_window_layers", source, minimum=0)
    _typed_field(hf, "mlp_bias", source, bool, False)
    use_sw = _typed_field(hf, "use_sliding_window", source, bool, hf.get("sliding_window") is not None)
    return {
        "architecture": archs[0],
        "vocab_size": ints["vocab_size"],
        "hidden_size": ints["hidden_size"],
        "intermediate_size": ints["intermediate_size"],
        "num_layers": ints["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": _int_field(hf, "head_dim", source, ints["hidden_size"] // heads),
        "rms_norm_eps": _number_field(hf, "rms_norm_eps", source, 1e-6),
        "max_position_embeddings": _int_field(hf, "max_position_embeddings", source, 2048),
        "tie_word_embeddings": _typed_field(hf, "tie_word_embeddings", source, bool, False),
        "attention_bias": _typed_field(hf, "attention_bias", source, bool, False),
        "hidden_act": _typed_field(hf, "hidden_act", source, str, "silu"),
        "sliding_window": _int_field(hf, "sliding_window", source) if use_sw else None,
        "eos_token_ids": _eos_ids(hf, source, ints["vocab_size"]),
        "bos_token_id": _int_field(hf, "bos_token_id", source, minimum=0),
    }


def _eos_ids(hf: dict[str, Any], source: str, vocab_size: int) -> tuple[int, ...]:
    """eos_token_id (an id or a list of ids, each in [0, vocab_size)) as a tuple."""
    eos = hf.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
        raise _bad_field(source, "eos_token_id", f"a token id or a list of token ids in [0, {vocab_size})", eos)
    return tuple(ids)


def _rope_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """RopeConfig keyword arguments from rope_parameters (new spelling) over rope_scaling over rope_theta."""
    merged: dict[str, Any] = {}
    for name in ("rope_scaling", "rope_parameters"):  # later wins
        sub = _typed_field(hf, name, source, dict, {})
        for key in _ROPE_NUMBERS:
            _number_field(sub, key, f"{source}: {name}", 1.0)
        _int_field(sub, "original_max_position_embeddings", f"{source}: {name}")
        for key in ("rope_type", "type"):
            _typed_field(sub, key, f"{source}: {name}", str, None)
        merged.update(sub)
    return {
        "theta": float(merged.get("rope_theta") or _number_field(hf, "rope_theta", source, 10000.0)),
        "rope_type": merged.get("rope_type") or merged.get("type") or "default",
        "factor": float(merged.get("factor") or 1.0),
        "low_freq_factor": float(merged.get("low_freq_factor") or 1.0),
        "high_freq_factor": float(merged.get("high_freq_factor") or 4.0),
        "original_max_position_embeddings": merged.get("original_max_position_embeddings") or 8192,
    }


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how many blocks (None = size from free memory)."""

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step, tokens per step, longest sequence."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    # False: a prompt is admitted only when all of it fits one step's token budget (vLLM's meaning)
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len}), or no long prompt could ever be scheduled")


CUDAGRAPH_MODES = ("full_and_piecewise", "full", "piecewise", "none")
PIECEWISE_MODES = ("full_and_piecewise", "piecewise")  # (piecewise graphs are graphs of compiled pieces)
# the compiled model's piece compilers (compilation_config's "backend"): Inductor, or none (the traced pieces as
# they are; docs/DECISIONS.md, S1)
COMPILE_BACKENDS = ("inductor", "eager")
DEFAULT_COMPILE_BACKEND = "eager"  # when compilation_config names none (docs/DECISIONS.md, S1)
# Triton kernels on CPU tensors run only under Triton's interpreter (tests/conftest.py skips on this refusal)
NEEDS_INTERPRETER = "on CPU needs TRITON_INTERPRET=1 (Triton's interpreter)"


def check_tensor_parallel(model: ModelConfig, size: int, device: torch.device) -> None:
    """ValueError unless `model` splits over `size` ranks (heads, intermediate size; KV heads split evenly or,
    when fewer than the ranks, replicated) and, on CUDA, there are that many devices."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    problems = []
    if model.num_heads % size:
        problems.append(f"num_attention_heads={model.num_heads} is not a multiple of it")
    kv = model.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"num_key_value_heads={kv} neither splits over it nor divides it (for replication)")
    if model.intermediate_size % size:
        problems.append(f"intermediate_size={model.intermediate_size} is not a multiple of it")
    if problems:
        raise ValueError(f"tensor_parallel_size={size} does not fit the model: " + "; ".join(problems))
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, {torch.cuda.device_count()} visible")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved: paths, device, dtype and the sub-configs."""

    model_dir: Path
    tokenizer_dir: Path
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    dtype: torch.dtype
    seed: int = 0
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    use_triton: bool = False  # device-side prep/sampling kernels; False = the PyTorch references
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (after penalties, temperature, filters)
    attention_backend: str = "reference"  # or "triton" (engine_args picks triton on CUDA)
    # a `graphrunner precompile` directory: compile the model from it (uncompiled: load its Triton kernels)
    compile_cache: Path | None = None
    # CUDA only, unless enforce_eager: "full_and_piecewise" (FULL graphs for plain uniform decodes and small mixed
    # steps, piecewise graphs for other steps), "full" (the FULL graphs only; other steps run without graphs),
    # "piecewise" (piecewise graphs only) or "none" (no graphs)
    cudagraph_mode: str = "full_and_piecewise"
    # False: the model runs uncompiled (compilation_config level 0): no Dynamo or Inductor at start-up, the FULL
    # graphs ("full" mode) record its kernels as they are (docs/DECISIONS.md, S1)
    torch_compile: bool = True
    # the compiled model's piece compiler, one of COMPILE_BACKENDS: "eager" runs the traced pieces as they are (no
    # Inductor; a warm start from a precompiled directory then loads them without Dynamo: capture/saved_graph.py)
    compile_backend: str = DEFAULT_COMPILE_BACKEND
    # batch sizes of the FULL decode graphs (compilation_config's cudagraph_capture_sizes); None = the model
    # state's default sizes; sizes over max_num_seqs are not captured
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for
    # "auto": sampling defaults from the model's generation_config.json; "vllm": none; else a folder holding one
    generation_config: str = "auto"
    skip_tokenizer_init: bool = False  # no tokenizer: prompts are token ids, outputs carry no text
    # ranks the model is split over (one process and one device each; rank r uses cuda:r)
    tensor_parallel_size: int = 1
    speculative: SpeculativeConfig | None = None  # speculative decoding; None = off

    def __post_init__(self) -> None:
        check_tensor_parallel(self.model, self.tensor_parallel_size, self.device)
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")
        if self.attention_backend not in ("reference", "triton"):
            raise ValueError(f"attention_backend must be 'reference' or 'triton', got {self.attention_backend!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend must be one of {COMPILE_BACKENDS}, got {self.compile_backend!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not isinstance(sizes, tuple) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be a list of batch sizes (integers >= 1), got {sizes!r}")
        if self.compile_cache is not None and self.enforce_eager:
            raise ValueError("compile_cache and enforce_eager=True contradict each other: pick one")
        if not self.torch_compile and self.cudagraph_mode in PIECEWISE_MODES and not self.enforce_eager:
            raise ValueError(f"cudagraph_mode={self.cudagraph_mode!r} needs the compiled model (its piecewise graphs "
                             f"are of compiled pieces): without compilation use cudagraph_mode='full' or 'none'")
        if self.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
            if self.attention_backend == "triton":
                raise ValueError(f"attention_backend='triton' {NEEDS_INTERPRETER}")
            if self.use_triton:
                raise ValueError(f"use_triton=True {NEEDS_INTERPRETER}")
