"""Resolving user-facing engine arguments (LLM(...) / CLI flags) into a frozen EngineConfig.

Defaults follow vLLM: the model directory's config.json decides max_model_len, "auto" dtype is
bf16 on GPU and fp32 on CPU; the demo model shipped with the package is used when no model is given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from graphrunner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, resolve_dtype

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"


def default_model_dir() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"no model given and the demo model is missing at {DEMO_MODEL_DIR}; pass model=DIR")
    return DEMO_MODEL_DIR


# "owner/name" as the Hugging Face Hub spells repository ids
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """The local model directory `model` names (the demo model for None); ValueError when it is not one."""
    if model is None:
        return default_model_dir()
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ValueError(f"model must be a local directory path, got {model!r}")
    model_dir = Path(model)
    if model_dir.is_dir():
        return model_dir
    if not model_dir.exists() and _HUB_ID.fullmatch(str(model)) and ".." not in str(model):
        raise ValueError(f"model {str(model)!r} is not a local directory; graphrunner downloads nothing: pass a local "
                         f"directory (e.g. one made by huggingface-cli download)")
    raise ValueError(f"model path {str(model_dir)!r} is not a directory (graphrunner loads local HF-format "
                     f"directories only; nothing is downloaded)")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None/"auto": $GRAPHRUNNER_DEVICE if set, else cuda when available, else cpu."""
    if device is None or device == "auto":
        device = os.environ.get("GRAPHRUNNER_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {device!r}; use 'cuda' or 'cpu'")
    return dev


def build_engine_config(
    model: str | Path | None = None,
    tokenizer: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    num_gpu_blocks_override: int | None = None,
    enforce_eager: bool = False,
    enable_prefix_caching: bool = False,
    device: str | torch.device | None = None,
    use_triton: bool | None = None,
    logprobs_mode: str = "raw_logprobs",
    attention_backend: str | None = None,
    compile_cache: str | Path | None = None,
    cudagraph_mode: str = "full_and_piecewise",
) -> EngineConfig:
    model_dir = resolve_model_dir(model)
    model_cfg = ModelConfig.from_dir(model_dir)
    dev = resolve_device(device)
    if max_model_len is None:
        max_model_len = model_cfg.max_position_embeddings
    elif max_model_len < 1 or max_model_len > model_cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} must be in [1, {model_cfg.max_position_embeddings}] "
                         f"(the model's max_position_embeddings)")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 8192
    return EngineConfig(
        model_dir=model_dir,
        tokenizer_dir=Path(tokenizer) if tokenizer is not None else model_dir,
        model=model_cfg,
        cache=CacheConfig(block_size, num_gpu_blocks_override, gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
        device=dev,
        dtype=resolve_dtype(dtype, dev),
        seed=seed,
        enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching,
        use_triton=(dev.type == "cuda") if use_triton is None else use_triton,
        logprobs_mode=logprobs_mode,
        attention_backend=attention_backend or ("triton" if dev.type == "cuda" else "reference"),
        compile_cache=Path(compile_cache) if compile_cache is not None else None,
        cudagraph_mode=cudagraph_mode,
    )
