"""Frozen configuration dataclasses: model, cache, scheduler and engine.

`ModelConfig.from_hf()` is the one place that knows the fallbacks between Hugging Face config
spellings (old `rope_theta`/`rope_scaling` vs new `rope_parameters`, missing `head_dim`, ...).
Every dataclass validates itself in `__post_init__` with messages that name the bad field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict, applying every HF fallback in one place."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot choose a model class")
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling = dict(hf.get("rope_scaling") or {})
        merged = {**rope_scaling, **rope_params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        rope = RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        use_sw = hf.get("use_sliding_window", hf.get("sliding_window") is not None)
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            sliding_window=hf.get("sliding_window") if use_sw else None,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            hf=dict(hf),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        return cls.from_hf(json.loads(path.read_text()))


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

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


CUDAGRAPH_MODES = ("full_and_piecewise", "piecewise", "none")


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
    compile_cache: Path | None = None  # a `graphrunner precompile` directory: compile the model from it
    # CUDA only, unless enforce_eager: "full_and_piecewise" (FULL graphs for plain uniform decodes, piecewise
    # graphs for other steps), "piecewise" (piecewise graphs only) or "none" (compiled, no graphs)
    cudagraph_mode: str = "full_and_piecewise"

    def __post_init__(self) -> None:
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")
        if self.attention_backend not in ("reference", "triton"):
            raise ValueError(f"attention_backend must be 'reference' or 'triton', got {self.attention_backend!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.compile_cache is not None and self.enforce_eager:
            raise ValueError("compile_cache and enforce_eager=True contradict each other: pick one")
        if self.attention_backend == "triton" and self.device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError("attention_backend='triton' on CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
