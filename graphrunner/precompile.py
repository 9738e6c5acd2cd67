"""`graphrunner precompile`: compile everything an engine with a given config will need, offline, into
one directory (Triton's caches, the model's saved graph or, with Inductor pieces, Inductor's cache and saved
compilation, and a manifest) that later engines start warm from. For an uncompiled engine (compilation level 0 with FULL graphs) that is the Triton kernels.

It lives in the front because it drives a real Engine; capture/compiled.py reads the directory back.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from capture.compiled import graph_sizes, manifest_for
from capture.manifest import MANIFEST_NAME
from graphrunner.config import EngineConfig
from graphrunner.engine import Engine
from graphrunner.sampling_params import SamplingParams
from graphrunner.worker import build_model_state

# Inductor's cache keys of a symbolic graph can depend on the size hint it was first traced with (and,
# before capture/compiled.py set backed_size_oblivious, Dynamo specialised token counts 0 and 1):
# precompile serves requests with prompts of these lengths one after another (re-tracing for each), then
# single-token decodes, so whichever variant a later run traces is in the cache.
WARMUP_TOKEN_COUNTS = (1, 3, 4, 16, 17, 64)


def save_compilation(engine: Engine, out_dir: Path) -> None:
    """The engine's compiled model saved whole, traced at the first step's shape: warm starts then load it instead
    of tracing (capture/aot.py; with eager pieces capture/saved_graph.py, loaded without Dynamo). Tensor-parallel
    ranks (in other processes) trace as before."""
    runner = engine.runner
    t = min(engine.config.scheduler.max_num_batched_tokens, engine.config.scheduler.max_model_len)
    model = getattr(runner.model, "_orig_mod", runner.model)
    if engine.config.compile_backend == "eager":
        from capture import saved_graph

        (out_dir / saved_graph.GRAPH_FILE).unlink(missing_ok=True)
        with runner.first_step_inputs(t) as args:
            saved_graph.save(model, args, out_dir)
        return
    from capture import aot  # (imports Dynamo)

    if not aot.available():
        return
    (out_dir / aot.MODEL_FILE).unlink(missing_ok=True)
    with runner.first_step_inputs(t) as args:
        aot.save(model, args, out_dir)


def precompile(config: EngineConfig, out_dir: Path) -> float:
    """Compile everything for `config` into out_dir (caches + manifest); returns the seconds it took.

    The compile happens inside a real engine serving short requests, so the cached graphs are
    exactly the ones a later run asks for (same input layouts, the token-count variants above).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    config = dataclasses.replace(config, compile_cache=out_dir)
    model_state = build_model_state(config)
    manifest_for(config, model_state).save(out_dir)  # first: the engine checks it before compiling
    # With CUDA graphs, building the engine compiles every variant a run meets, traced in a fixed order
    # (capture runs the largest bucket first, then down to one token): on the H200 a warm start asked
    # for exactly the graphs the engine's construction made. Without graphs the first trace's size
    # hint is the first request's length, so each count is served after a fresh Dynamo state.
    retrace = graph_sizes(config, model_state) == ([], []) and config.torch_compile
    engine = None
    try:
        engine = Engine(config, model_state)
        for count in WARMUP_TOKEN_COUNTS[1:] if retrace else WARMUP_TOKEN_COUNTS[-1:]:
            if retrace:
                import torch._dynamo

                torch._dynamo.reset()  # re-trace with this count as the size hint
            engine.add_request({"prompt_token_ids": [0] * count}, SamplingParams(temperature=0.0, max_tokens=2))
            while engine.has_unfinished():
                engine.step()
        if config.torch_compile and config.tensor_parallel_size == 1:
            save_compilation(engine, out_dir)
    except BaseException:
        (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # a half-built cache must not look valid
        raise
    finally:
        if engine is not None:
            engine.shutdown()  # tensor-parallel workers (their compiled pieces are in out_dir too)
    return time.perf_counter() - start
