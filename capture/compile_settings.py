"""Dynamo's and Inductor's settings for every model graphrunner compiles (the target through the piecewise backend,
a proposer through plain Inductor, and an AOT-compiled model when it is saved or loaded).
"""

from __future__ import annotations

import os

import torch
import torch.fx.experimental._config as fx_config

# Dynamo counts compiled variants per code object, and every engine's model (same class, another
# instance) adds its own: several engines in one process would hit the default limit of 8 and, with
# fullgraph=True, fail.
RECOMPILE_LIMIT = 64


def configure_dynamo() -> None:
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


def configure_inductor() -> None:
    for name, value in parse_inductor_overrides(os.environ.get("GRAPHRUNNER_INDUCTOR_CONFIG", "")).items():
        setattr(torch._inductor.config, name, value)


def configure_compilers() -> None:
    """Dynamo's and Inductor's settings for the model (also before an AOT-compiled model is saved or loaded)."""
    configure_dynamo()
    configure_inductor()
