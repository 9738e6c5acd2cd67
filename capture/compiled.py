"""Compiling the model with the piecewise backend, and warm starts from a precompiled directory.

A precompiled directory (made by the front's `graphrunner.precompile`) holds Inductor's and Triton's
caches plus a manifest; an engine given that directory checks the manifest, points the caches at
it, and compiles from cache hits.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from capture.manifest import Manifest
from capture.piecewise import PiecewiseBackend
from graphrunner.config import EngineConfig
from model_states.base import ModelState


def use_compile_cache(cache_dir: Path) -> None:
    """Point Inductor's and Triton's on-disk caches at cache_dir (before anything is compiled), with
    AOTAutograd's cache on too, so a warm start neither re-traces nor re-compiles a piece.

    (The cache once missed a graph on the H200: Dynamo had lifted float attributes as 0-d inputs,
    differently per process. `compile_model` now specialises floats, and every piece is a hit.)
    """
    import torch._functorch.config as functorch_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    torch._inductor.config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True


# Dynamo counts compiled variants per code object, and every engine's model (same class, another
# instance) adds its own: several engines in one process would hit the default limit of 8 and, with
# fullgraph=True, fail.
RECOMPILE_LIMIT = 64


def _configure_dynamo() -> None:
    """Dynamo settings every compiled module here shares (the target and a proposer's module)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    # Float module attributes (norm eps, attention scale) are constants of a model. Traced as symbolic
    # floats, Dynamo's scalar pass later gives up on them and restarts the whole trace (twice on the
    # demo model: 3x Dynamo's time), and the lifted 0-d inputs differed between processes, which
    # defeated AOTAutograd's cache. Specialised, the model traces once.
    if hasattr(cfg, "specialize_float"):
        cfg.specialize_float = True
    # The profiling step's views span whole step buffers: duck sizing would give a view and its base
    # one symbol, and the next (shorter) step would compile a third variant next to the general one
    # and the one-token one (12 s of Dynamo on the 28-layer model).
    fx_config.use_duck_shape = False
    # Dynamo specialises sizes 0 and 1: the first one-token step (every decode at batch 1, and the
    # one-token capture) traced the whole model a second time, on a warm start too (7.5 s of 32.6 s on
    # the H200's 28 layers). Size-oblivious symbols keep one general graph for every token count (the
    # models avoid the ops that still guard on t == 1: reshape/contiguous of a strided view).
    if hasattr(fx_config, "backed_size_oblivious"):
        fx_config.backed_size_oblivious = True


def parse_inductor_overrides(raw: str) -> dict[str, bool | int | float | str]:
    """"name=value,name=value" (GRAPHRUNNER_INDUCTOR_CONFIG) -> {name: value} for torch._inductor.config, values
    read as bool (true/false), int, float or else a string; ValueError naming a malformed item or unknown name.
    For A/Bs of Inductor's options (e.g. combo_kernels=1, coordinate_descent_tuning=1) without code changes."""
    out: dict[str, bool | int | float | str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name or not text:
            raise ValueError(f"GRAPHRUNNER_INDUCTOR_CONFIG items are name=value, got {item!r}")
        if not hasattr(torch._inductor.config, name):
            raise ValueError(f"GRAPHRUNNER_INDUCTOR_CONFIG: torch._inductor.config has no option {name!r}")
        value: bool | int | float | str
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    value = text
        if isinstance(getattr(torch._inductor.config, name), bool) and value in (0, 1):
            value = bool(value)
        out[name] = value
    return out


def _configure_inductor() -> None:
    for name, value in parse_inductor_overrides(os.environ.get("GRAPHRUNNER_INDUCTOR_CONFIG", "")).items():
        setattr(torch._inductor.config, name, value)


def compile_model(model: nn.Module, backend: PiecewiseBackend | None = None) -> nn.Module:
    """The model behind torch.compile with the piecewise backend (attention stays outside the pieces)."""
    _configure_dynamo()
    _configure_inductor()
    return torch.compile(model, backend=backend or PiecewiseBackend(), fullgraph=True, dynamic=True)


def compile_draft(module: nn.Module) -> nn.Module:
    """A proposer's module (the draft model, the EAGLE head) behind plain Inductor: fused kernels, no pieces.
    Its forwards run inside the target's FULL verify graphs (or between a mixed step's pieces), so it needs no
    graphs of its own; eager, each layer was ~25 small kernels, and a k = 4 verify step with the 8-layer demo
    draft cost 5.3x a plain decode step of its 24-layer target (docs/BENCHMARKS.md, tenth session)."""
    _configure_dynamo()
    return torch.compile(module, backend="inductor", fullgraph=True, dynamic=True)


def graph_sizes(config: EngineConfig, model_state: ModelState) -> tuple[list[int], list[int]]:
    """(FULL decode batch sizes, piecewise token buckets) an engine with this config captures; both
    empty where it captures no CUDA graphs (CPU, enforce_eager, cudagraph_mode="none")."""
    if config.device.type != "cuda" or config.enforce_eager or config.cudagraph_mode == "none":
        return [], []
    sc = config.scheduler
    full = config.cudagraph_mode == "full_and_piecewise" and config.attention_backend == "triton"
    return ((model_state.decode_batch_sizes(sc.max_num_seqs) if full else []),
            model_state.token_buckets(sc.max_num_batched_tokens))


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
                            config.tensor_parallel_size)


def prepare_compiled_model(model: nn.Module, config: EngineConfig, model_state: ModelState
                           ) -> tuple[nn.Module, PiecewiseBackend]:
    """For an engine: with a compile cache, check its manifest against this run and point the caches at it;
    then compile. Returns the compiled model and its backend (which lists the pieces it made)."""
    cache_dir = config.compile_cache
    if cache_dir is not None:
        Manifest.load(cache_dir).check_matches(manifest_for(config, model_state), cache_dir)
        use_compile_cache(cache_dir)
    backend = PiecewiseBackend()
    return compile_model(model, backend), backend
