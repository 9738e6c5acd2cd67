"""Compiling the model with the piecewise backend, and warm starts from a precompiled directory.

A precompiled directory (made by the front's `graphrunner.precompile`) holds Inductor's and Triton's
caches plus a manifest; an engine given that directory checks the manifest, points the caches at
it, and compiles from cache hits (an uncompiled engine only loads its Triton kernels from it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capture import saved_graph
from capture.compile_settings import configure_compilers, configure_dynamo
from capture.manifest import Manifest
from capture.piecewise import PiecewiseBackend, eager_piece
from graphrunner.config import PIECEWISE_MODES, EngineConfig
from graphrunner.opaque import trace_without_fusion
from model_states.base import ModelState


def use_compile_cache(cache_dir: Path) -> None:
    """Point Inductor's on-disk cache at cache_dir (before anything is compiled; Triton's: use_kernel_cache), with
    AOTAutograd's cache on too, so a warm start neither re-traces nor re-compiles a piece.

    (The cache once missed a graph on the H200: Dynamo had lifted float attributes as 0-d inputs,
    differently per process. `compile_model` now specialises floats, and every piece is a hit.)
    """
    import torch._functorch.config as functorch_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    torch._inductor.config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True


def use_kernel_cache(config: EngineConfig, model_state: ModelState) -> None:
    """Check config.compile_cache's manifest against this run and point Triton's cache at it (its kernels then load
    instead of compiling): all an uncompiled engine (torch_compile=False) takes from a precompiled directory."""
    cache_dir = config.compile_cache
    assert cache_dir is not None
    Manifest.load(cache_dir).check_matches(manifest_for(config, model_state), cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")


def compile_model(model: nn.Module, backend: PiecewiseBackend | None = None) -> nn.Module:
    """The model behind torch.compile with the piecewise backend (attention stays outside the pieces); with eager
    pieces, traced in every op's eager form (UnfusedTrace)."""
    configure_compilers()
    backend = backend or PiecewiseBackend()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    return UnfusedTrace(model, compiled) if backend.compile_piece is eager_piece else compiled


class UnfusedTrace(nn.Module):
    """A compiled model whose pieces nothing fuses: each call runs under opaque.trace_without_fusion, so whenever
    Dynamo traces it (the first call, or a guard's re-trace) the few ops with a PyTorch form for Inductor take
    their Triton launch instead, as the uncompiled model does. Every other attribute is the model's."""

    def __init__(self, model: nn.Module, compiled: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model
        self._compiled = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with trace_without_fusion():
            return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def compile_draft(module: nn.Module) -> nn.Module:
    """A proposer's module (the draft model, the EAGLE head) behind plain Inductor: fused kernels, no pieces.
    Its forwards run inside the target's FULL verify graphs (or between a mixed step's pieces), so it needs no
    graphs of its own; eager, each layer was ~25 small kernels, and a k = 4 verify step with the 8-layer demo
    draft cost 5.3x a plain decode step of its 24-layer target (docs/BENCHMARKS.md, tenth session)."""
    configure_dynamo()
    return torch.compile(module, backend="inductor", fullgraph=True, dynamic=True)


def graph_sizes(config: EngineConfig, model_state: ModelState) -> tuple[list[int], list[int]]:
    """(FULL decode batch sizes, piecewise token buckets) an engine with this config captures; both
    empty where it captures no CUDA graphs (CPU, enforce_eager, cudagraph_mode="none")."""
    if config.device.type != "cuda" or config.enforce_eager or config.cudagraph_mode == "none":
        return [], []
    sc = config.scheduler
    full = config.cudagraph_mode in ("full_and_piecewise", "full") and config.attention_backend == "triton"
    return ((model_state.decode_batch_sizes(sc.max_num_seqs, config.cudagraph_capture_sizes) if full else []),
            model_state.token_buckets(sc.max_num_batched_tokens) if config.cudagraph_mode in PIECEWISE_MODES else [])


def mixed_graph_sizes(config: EngineConfig, model_state: ModelState) -> list[tuple[int, int]]:
    """(batch size, tokens) of the mixed FULL graphs an engine with this config captures. They need an
    attention backend that reads every length on the device (the Triton one; the reference backend
    sizes its work from host lengths)."""
    if not graph_sizes(config, model_state)[0]:
        return []
    sc = config.scheduler
    return model_state.mixed_full_sizes(sc.max_num_seqs, sc.max_num_batched_tokens)


def manifest_for(config: EngineConfig, model_state: ModelState) -> Manifest:
    full, buckets = graph_sizes(config, model_state)
    return Manifest.current(config.model_dir, config.dtype, config.device, tuple(buckets), tuple(full),
                            config.tensor_parallel_size, config.torch_compile,
                            config.compile_backend if config.torch_compile else "")


def prepare_compiled_model(model: nn.Module, config: EngineConfig, model_state: ModelState
                           ) -> tuple[nn.Module, PiecewiseBackend | saved_graph.SavedPieces]:
    """For an engine: with a compile cache, check its manifest against this run and point the caches at it, and
    load the model's saved compilation from it where there is a fresh one (capture/aot.py; with eager pieces,
    capture/saved_graph.py, which needs neither Dynamo nor Inductor); otherwise compile.
    Returns the compiled model and what lists its pieces (a backend, or the saved graph's pieces)."""
    cache_dir = config.compile_cache
    eager = config.compile_backend == "eager"
    if cache_dir is not None:
        use_kernel_cache(config, model_state)
        if eager:
            # only a proposer (draft model, EAGLE head) compiles with Inductor here: its cache, without touching
            # Inductor's config (whose import brings Dynamo and sympy with it)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
            saved = saved_graph.load(cache_dir, model) if config.tensor_parallel_size == 1 else None
            if saved is not None:
                return saved
        else:
            from capture import aot  # (imports Dynamo: only an engine that compiles pays for it)

            use_compile_cache(cache_dir)
            loaded = aot.load(cache_dir, model, lambda b: compile_model(model, b)) \
                if config.tensor_parallel_size == 1 else None
            if loaded is not None:
                return loaded
    backend = PiecewiseBackend.named(config.compile_backend)
    return compile_model(model, backend), backend


def loaded_saved_compilation(model: nn.Module) -> bool:
    """Whether prepare_compiled_model loaded `model`'s saved compilation (capture/aot.py) rather than compiling."""
    if isinstance(model, saved_graph.SavedGraphModel):
        return True
    aot = sys.modules.get("capture.aot")  # never imported: nothing was loaded
    return aot is not None and isinstance(model, aot.AOTCompiledModel)
