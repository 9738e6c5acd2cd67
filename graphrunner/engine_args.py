"""Resolving user-facing engine arguments (LLM(...) / CLI flags) into a frozen EngineConfig.

Defaults follow vLLM: the model directory's config.json decides max_model_len, "auto" dtype is
bf16 on GPU and fp32 on CPU; the demo model shipped with the package is used when no model is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphrunner.argparse_utils import json_value
from graphrunner.config import (
    COMPILE_BACKENDS,
    DEFAULT_COMPILE_BACKEND,
    PIECEWISE_MODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from graphrunner.spec_config import SpeculativeConfig

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


def build_engine_config(**kwargs: Any) -> EngineConfig:
    """EngineConfig from keyword engine arguments (EngineArgs' fields)."""
    return EngineArgs(**kwargs).create_engine_config()


_CUDAGRAPH_MODES = {"NONE": "none", "PIECEWISE": "piecewise", "FULL_AND_PIECEWISE": "full_and_piecewise",
                    "FULL": "full", "FULL_DECODE_ONLY": "full"}


def _capture_sizes(value: Any) -> Any:
    """compilation_config's cudagraph_capture_sizes as EngineConfig holds them (a list becomes a tuple; EngineConfig
    validates them)."""
    return tuple(value) if isinstance(value, list) else value


@dataclass
class EngineArgs:
    """vLLM's engine arguments (the keyword arguments of `LLM(...)`), resolved by `create_engine_config()`.

    Fields that mean something here act; those of features graphrunner does not have are accepted only at
    their inert values and otherwise refused with a one-line reason (see `_refusals`).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = False
    generation_config: str = "auto"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    compilation_config: int | dict[str, Any] | None = None
    speculative_config: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    hf_token: str | bool | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    swap_space: float = 4.0  # accepted: preemption recomputes, nothing is swapped
    cpu_offload_gb: float = 0.0
    disable_custom_all_reduce: bool = False  # accepted: all-reduces are torch.distributed's (NCCL / gloo)
    distributed_executor_backend: str | None = None
    enable_lora: bool = False
    served_model_name: str | None = None
    profiler_config: dict[str, Any] | None = None  # {"profiler": "torch", "torch_profiler_dir": DIR}
    # graphrunner's own
    device: str | None = None
    use_triton: bool | None = None
    logprobs_mode: str = "raw_logprobs"
    attention_backend: str | None = None
    compile_cache: str | None = None
    cudagraph_mode: str = "full_and_piecewise"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One --flag per field (vLLM's spelling: --max-model-len), defaults from the dataclass."""
        group = parser.add_argument_group("Engine arguments")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            args = typing.get_args(kind)
            if kind is bool or bool in args:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            elif dict in {typing.get_origin(a) or a for a in args} or typing.get_origin(kind) is dict:
                group.add_argument(flag, type=json_value, default=f.default, help="JSON (or a level, -O3 style)")
            else:
                scalar = next((a for a in (args or (kind,)) if a in (int, float, str)), str)
                group.add_argument(flag, type=scalar, default=f.default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def _refusals(self) -> list[str]:
        checks = [
            (self.trust_remote_code, "trust_remote_code=True: graphrunner never runs code from a model directory"),
            (self.pipeline_parallel_size != 1, "pipeline_parallel_size != 1: pipeline parallelism is not supported"),
            (self.data_parallel_size != 1, "data_parallel_size != 1: run one engine per device instead"),
            (self.kv_cache_dtype != "auto",
             f"kv_cache_dtype={self.kv_cache_dtype!r}: the KV cache is kept in the model dtype ('auto' only)"),
            (self.quantization is not None, f"quantization={self.quantization!r}: quantized models are not supported"),
            (self.revision is not None or self.tokenizer_revision is not None,
             "revision / tokenizer_revision: nothing is downloaded; pass a local directory at the wanted revision"),
            (self.hf_token not in (None, False), "hf_token: nothing is downloaded; pass a local directory"),
            (self.download_dir is not None, "download_dir: nothing is downloaded; pass a local directory"),
            (self.load_format not in ("auto", "safetensors"), f"load_format={self.load_format!r}: safetensors only"),
            (self.tokenizer_mode not in ("auto", "hf"),
             f"tokenizer_mode={self.tokenizer_mode!r}: the model's (fast) tokenizer is always used"),
            (self.cpu_offload_gb != 0, "cpu_offload_gb: weights stay on the device"),
            (self.enable_lora, "enable_lora=True: LoRA adapters are not supported"),
            (self.distributed_executor_backend not in (None, "uni", "mp"),
             (f"distributed_executor_backend={self.distributed_executor_backend!r}: 'mp' (one process per rank) "
              f"or 'uni' (one rank) only")),
            (self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1,
             "distributed_executor_backend='uni' runs one rank: tensor_parallel_size must be 1 (or use 'mp')"),
        ]
        return [reason for refused, reason in checks if refused]

    def _compilation(self) -> tuple[bool, str, tuple[int, ...] | None, bool, str]:
        """(enforce_eager, cudagraph_mode, cudagraph_capture_sizes, torch_compile, compile_backend) after vLLM's
        compilation_config: a level / mode number or a dict. Level 0 is vLLM's no compilation: no graphs either,
        unless a FULL cudagraph_mode asks for graphs of the uncompiled model. "backend" is the compiled model's piece
        compiler, as in vLLM's key: "eager" (or "" or unset: the default, DEFAULT_COMPILE_BACKEND) or "inductor"."""
        cc = self.compilation_config
        eager, mode = self.enforce_eager, self.cudagraph_mode
        if cc is None:
            return eager, mode, None, True, DEFAULT_COMPILE_BACKEND
        if isinstance(cc, int) and not isinstance(cc, bool):
            cc = {"level": cc}
        if not isinstance(cc, dict):
            raise ValueError(f"compilation_config must be a level (0-3) or a dict, got {cc!r}")
        unknown = sorted(set(cc) - {"level", "mode", "cudagraph_mode", "cudagraph_capture_sizes", "backend"})
        if unknown:
            raise ValueError(f"compilation_config keys {unknown} are not supported; known: level, mode, "
                             f"cudagraph_mode, cudagraph_capture_sizes, backend")
        backend = cc.get("backend")
        backend = DEFAULT_COMPILE_BACKEND if backend is None or backend == "" else backend  # (unset, or vLLM's "")
        if not isinstance(backend, str) or backend not in COMPILE_BACKENDS:
            raise ValueError(f"compilation_config backend {cc['backend']!r}: expected one of {list(COMPILE_BACKENDS)} "
                             f"(the compiled model's piece compiler)")
        if "cudagraph_mode" in cc:
            name = str(cc["cudagraph_mode"]).upper()
            if name not in _CUDAGRAPH_MODES:
                raise ValueError(f"compilation_config cudagraph_mode {cc['cudagraph_mode']!r}: expected one of "
                                 f"{sorted(_CUDAGRAPH_MODES)}")
            mode = _CUDAGRAPH_MODES[name]
        level = cc.get("mode", cc.get("level"))
        compiled = True
        if level is not None:
            if level not in (0, 1, 2, 3):
                raise ValueError(f"compilation_config level must be 0-3, got {level!r}")
            compiled = level != 0  # 1-3: compiled, with the cudagraph_mode's graphs
            if level == 0 and "cudagraph_mode" in cc and mode in PIECEWISE_MODES:
                raise ValueError(f"compilation_config level 0 (no compilation) with cudagraph_mode "
                                 f"{cc['cudagraph_mode']!r}: piecewise graphs are of compiled pieces; use FULL or NONE")
            if level == 0 and mode != "full":
                eager = True  # vLLM's level 0: no compilation and, unless FULL graphs are asked for, no graphs
            if level == 0 and cc.get("backend"):
                raise ValueError(f"compilation_config level 0 (no compilation) with backend {cc['backend']!r}: the "
                                 f"backend compiles the model's pieces; drop one of the two")
        return eager, mode, _capture_sizes(cc.get("cudagraph_capture_sizes")), compiled, backend

    def create_engine_config(self) -> EngineConfig:
        refusals = self._refusals()
        if refusals:
            raise ValueError("unsupported engine argument: " + "; ".join(refusals))
        model_dir = resolve_model_dir(self.model)
        model_cfg = ModelConfig.from_dir(model_dir)
        dev = resolve_device(self.device)
        max_len = self.max_model_len
        if max_len is None:
            max_len = model_cfg.max_position_embeddings
        elif not isinstance(max_len, int) or max_len < 1 or max_len > model_cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} must be in [1, {model_cfg.max_position_embeddings}] "
                             f"(the model's max_position_embeddings)")
        chunked = self.enable_chunked_prefill is not False
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if chunked else max(8192, max_len)
        eager, graph_mode, capture_sizes, compiled, compile_backend = self._compilation()
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        return EngineConfig(
            model_dir=model_dir,
            tokenizer_dir=Path(self.tokenizer) if self.tokenizer is not None else model_dir,
            model=model_cfg,
            cache=CacheConfig(self.block_size, self.num_gpu_blocks_override, self.gpu_memory_utilization),
            scheduler=SchedulerConfig(self.max_num_seqs, batched, max_len, chunked),
            device=dev,
            dtype=resolve_dtype(self.dtype, dev),
            seed=0 if self.seed is None else self.seed,
            enforce_eager=eager,
            enable_prefix_caching=self.enable_prefix_caching is not False,  # on by default, as in vLLM
            use_triton=(dev.type == "cuda") if self.use_triton is None else self.use_triton,
            logprobs_mode=self.logprobs_mode,
            attention_backend=self.attention_backend or ("triton" if dev.type == "cuda" else "reference"),
            compile_cache=Path(self.compile_cache) if self.compile_cache is not None else None,
            cudagraph_mode=graph_mode,
            torch_compile=compiled,
            compile_backend=compile_backend,
            cudagraph_capture_sizes=capture_sizes,
            max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
            skip_tokenizer_init=self.skip_tokenizer_init,
            tensor_parallel_size=self.tensor_parallel_size,
            speculative=self._speculative_for_tp(),
        )

    def _speculative_for_tp(self) -> SpeculativeConfig | None:
        spec = self._speculative()
        if spec is not None and self.tensor_parallel_size not in (None, 1):
            raise ValueError("speculative_config with tensor_parallel_size > 1 is not supported yet: the verify step's "
                             "drafts and accepted counts are per rank-0 state table; use one or the other")
        return spec

    def _speculative(self) -> SpeculativeConfig | None:
        raw = self.speculative_config
        if isinstance(raw, str):  # a JSON string, as `--speculative-config '{...}'` may pass it through Python
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                raise ValueError(f"speculative_config is not valid JSON: {raw!r}") from None
        return None if raw is None else SpeculativeConfig.from_dict(raw)
