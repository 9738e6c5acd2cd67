"""Building the device side of an engine: the ModelState (once), model, KV cache sized to free memory,
state table, runner, and the capture manager wired to the runner's step bodies.

On CUDA the KV cache takes what a profiling forward of the largest step leaves free under
gpu_memory_utilization; on CPU it is capped so a laptop is not asked for gigabytes. With tensor
parallelism each rank holds its KV heads, and every rank takes the smallest block count any can hold.
"""

from __future__ import annotations

import gc
import logging
import time
import zlib
from pathlib import Path

import torch

from capture.compiled import (
    compile_draft,
    graph_sizes,
    loaded_saved_compilation,
    mixed_graph_sizes,
    prepare_compiled_model,
    use_kernel_cache,
)
from capture.manager import CaptureManager
from graphrunner.config import EngineConfig, ModelConfig
from graphrunner.env import env_choice
from graphrunner.kv_cache import allocate_kv_cache, blocks_needed, kv_bytes_per_block
from graphrunner.loader import load_model
from graphrunner.parallel_state import check_same_across_ranks, min_across_ranks, rank_kv_config, tp_rank, tp_size
from graphrunner.runner import ModelRunner
from graphrunner.spec_decode.draft_model import DraftModel
from graphrunner.spec_decode.eagle import EagleDraft
from graphrunner.state_table import StateTable
from model_states import ModelState, get_model_state
from model_states.eagle import EagleModelState

# GRAPHRUNNER_GC_FREEZE=1: gc.freeze() once the runner is ready (vLLM's freeze_gc_heap), so a step's garbage
# collections do not walk start-up's objects; off until measured (docs/DECISIONS.md)
GC_FREEZE = env_choice("GRAPHRUNNER_GC_FREEZE", ("0", "1"), "0") == "1"

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 256 << 20  # a laptop-sized default; num_gpu_blocks_override raises it
# The pool measured with the largest graphs, plus room for the smaller graphs' own outputs and
# fragmentation when every size is captured into it.
GRAPH_POOL_MARGIN = 1.25


def build_model_state(config: EngineConfig) -> ModelState:
    """The engine's one ModelState: the registry's class for the architecture, with the engine's block size."""
    k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
    return get_model_state(config.model.architecture)(config.model, block_size=config.cache.block_size,
                                                      num_speculative_tokens=k)


def _profile_peak_bytes(runner: ModelRunner, config: EngineConfig) -> int:
    """Peak CUDA memory of a forward over max_num_batched_tokens tokens (one prefill, nothing written).

    The inputs are the runner's own step buffers: a compiled model then sees the same kind of tensor
    here as in every later step (fresh inference tensors would make Dynamo compile a second variant)."""
    sc = config.scheduler
    t = min(sc.max_num_batched_tokens, sc.max_model_len)
    torch.cuda.reset_peak_memory_stats(config.device)
    with torch.inference_mode():
        inputs, shape = runner.model_state.dummy_inputs(runner.buffers, t, prefill=True)
        hidden = runner.run_model(inputs, shape)
        runner.model.compute_logits(hidden[: sc.max_num_seqs])
    torch.cuda.synchronize(config.device)
    peak = torch.cuda.max_memory_allocated(config.device)
    del hidden
    torch.cuda.empty_cache()
    return peak


def choose_num_blocks(config: EngineConfig, peak_bytes: int = 0, reserved_bytes: int = 0) -> int:
    """KV blocks that fit: on CUDA, what gpu_memory_utilization leaves after the profiled peak and
    `reserved_bytes` (the CUDA-graph pool); on CPU, a laptop-sized cap."""
    cache, sc = config.cache, config.scheduler
    per_block = kv_bytes_per_block(rank_kv_config(config.model), cache.block_size, config.dtype)
    spec = config.speculative
    if spec is not None and spec.model is not None:  # a draft model (EAGLE head) keeps a cache of as many blocks
        per_block += kv_bytes_per_block(ModelConfig.from_dir(spec.model), cache.block_size, config.dtype)
    if cache.num_blocks is not None:
        return cache.num_blocks
    want = sc.max_num_seqs * blocks_needed(sc.max_model_len, cache.block_size) + 1
    if config.device.type != "cuda":
        return max(2, min(want, CPU_KV_CAP_BYTES // per_block))
    _, total = torch.cuda.mem_get_info(config.device)
    budget = int(total * cache.gpu_memory_utilization) - peak_bytes - reserved_bytes
    num = min(want, budget // per_block)
    if num < 2:
        raise ValueError(f"no memory left for the KV cache: model + activations take {peak_bytes / 2**30:.1f} GiB "
                         f"and CUDA graphs {reserved_bytes / 2**30:.1f} GiB of "
                         f"{total * cache.gpu_memory_utilization / 2**30:.1f} GiB; raise gpu_memory_utilization "
                         f"or pass enforce_eager=True")
    return num


def _load_draft(config: EngineConfig) -> DraftModel | None:
    """The draft model of speculative method "draft_model": same vocabulary as the target, its own ModelState;
    its KV cache is allocated once the block count is known."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    draft_dir = Path(spec.model)
    if not (draft_dir / "config.json").is_file():
        raise ValueError(f"speculative_config model {spec.model!r} is not a model directory (no config.json)")
    draft_cfg = ModelConfig.from_dir(draft_dir)
    if draft_cfg.vocab_size != config.model.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) differs from the target's "
                         f"({config.model.vocab_size}); a draft model must share the target's tokenizer")
    state = get_model_state(draft_cfg.architecture)(draft_cfg, block_size=config.cache.block_size)
    model = load_model(draft_dir, state, config.dtype, config.device)
    return DraftModel(model, state, allocate_kv_cache(draft_cfg, 2, config.cache.block_size, config.dtype,
                                                      config.device))


def _load_eagle(config: EngineConfig) -> EagleDraft | None:
    """The EAGLE head of speculative method "eagle" (it shares the target's embedding and LM head); its KV cache is
    allocated once the block count is known."""
    spec = config.speculative
    if spec is None or spec.method != "eagle" or spec.model is None:
        return None
    state = EagleModelState.from_dir(spec.model, config.model, config.cache.block_size)
    head = load_model(Path(spec.model), state, config.dtype, config.device)
    return EagleDraft(head, state, allocate_kv_cache(state.config, 2, config.cache.block_size, config.dtype,
                                                     config.device))


def build_runner(config: EngineConfig, model_state: ModelState | None = None) -> tuple[ModelRunner, int]:
    """Load (and compile) the model, capture its CUDA graphs and size the KV cache around them; returns
    (runner, num KV blocks).

    With graphs, the largest graphs are captured first against a placeholder cache to measure the
    pool, the real cache takes what is left, and then every graph is captured against it (a graph
    bakes in the cache's address).
    """
    progress = _Progress(config)
    model_state = model_state or build_model_state(config)
    model = load_model(config.model_dir, model_state, config.dtype, config.device)
    progress("model loaded")
    graphs_on_gpu = config.device.type == "cuda" and not config.enforce_eager
    compile_on_gpu = graphs_on_gpu and config.torch_compile
    backend = None
    if not config.torch_compile and config.compile_cache is not None:
        use_kernel_cache(config, model_state)  # the precompiled kernels, for the uncompiled model
    elif config.compile_cache is not None or compile_on_gpu:
        model, backend = prepare_compiled_model(model, config, model_state)
        progress("loaded the saved compilation" if loaded_saved_compilation(model)
                 else "set up the compiler (the model is traced at its first step)")
    sc, bs = config.scheduler, config.cache.block_size
    state = StateTable(sc.max_num_seqs, sc.max_model_len, blocks_needed(sc.max_model_len, bs), config.device,
                       config.use_triton, config.model.vocab_size)  # penalty statistics: docs/DECISIONS.md
    kv_model = rank_kv_config(config.model)
    placeholder = allocate_kv_cache(kv_model, 2, bs, config.dtype, config.device)
    draft = _load_draft(config) or _load_eagle(config)
    if isinstance(draft, DraftModel) and compile_on_gpu:
        draft.model = compile_draft(draft.model)
    elif isinstance(draft, EagleDraft) and compile_on_gpu:
        draft.head = compile_draft(draft.head)
    runner = ModelRunner(model, model_state, placeholder, state, config.use_triton, config.logprobs_mode,
                         config.attention_backend, sc.max_num_batched_tokens, config.speculative, draft)
    manager = None
    if graphs_on_gpu and config.cudagraph_mode != "none":
        full_sizes, token_sizes = graph_sizes(config, model_state)
        pieces = backend.graph_pieces if backend is not None else None
        manager = CaptureManager(model_state, runner.buffers, pieces, full_sizes, token_sizes, sc.max_model_len,
                                 mixed_graph_sizes(config, model_state))
    # every rank must run the same forwards (each holds collectives) in the same order from here on
    plan = (config.device.type == "cuda" and config.cache.num_blocks is None, sc.max_num_batched_tokens,
            None if manager is None else (manager.full_keys(), manager.token_sizes, manager.mixed_sizes))
    check_same_across_ranks(zlib.crc32(repr(plan).encode()), "the start-up forwards and CUDA graphs")
    try:
        peak = reserved = 0
        if config.device.type == "cuda" and config.cache.num_blocks is None:
            peak = _profile_peak_bytes(runner, config)  # (compiles the model at the largest step first)
            pieces = f", {backend.compiled_pieces} distinct pieces compiled" if backend is not None else ""
            progress(f"profiled (compiled) the largest step: peak {peak / 2**30:.2f} GiB{pieces}")
        if manager is not None:
            manager.capture(runner.capture_bodies(), largest_only=True)
            reserved = int(manager.pool_bytes * GRAPH_POOL_MARGIN)
            progress(f"captured the largest graphs: pool {manager.pool_bytes / 2**30:.2f} GiB")
        mine = choose_num_blocks(config, peak, reserved)
        num_blocks = min_across_ranks(mine)  # one block count for every rank
        progress(f"KV cache: {num_blocks} blocks (this rank could hold {mine})")
        runner.kv_cache = allocate_kv_cache(kv_model, num_blocks, bs, config.dtype, config.device)
        if draft is not None:  # the same block ids index the draft model's (EAGLE head's) own cache
            draft.kv_cache = allocate_kv_cache(draft.model_state.config, num_blocks, bs, config.dtype, config.device)
        del placeholder
        if manager is not None:
            manager.capture(runner.capture_bodies())
            runner.graphs = manager
            progress(f"captured {manager.num_graphs} graphs in {manager.capture_seconds:.1f} s "
                     f"({manager.piecewise_capture_seconds:.1f} s of them in {len(manager.token_sizes)} piecewise buckets, "
                     f"{manager.full_warmup_seconds:.1f} s in the FULL graphs' warm-up steps)")
    except BaseException:
        if manager is not None:  # graphs holding collectives would keep the group from being left
            manager.retire()
        raise
    if GC_FREEZE:  # start-up's objects (traced graphs, compiled code, captured graphs) leave the collector's scans
        gc.collect()
        gc.freeze()
    progress("runner ready")
    return runner, num_blocks


class _Progress:
    """INFO lines through start-up, naming the rank and the seconds since the previous one: with tensor
    parallelism, where each rank stopped shows where a hang waits (GRAPHRUNNER_LOG_LEVEL=INFO shows them)."""

    def __init__(self, config: EngineConfig) -> None:
        self.where = f"rank {tp_rank()}/{tp_size()} on {config.device}"
        self.last = time.perf_counter()
        logger.info("%s: building the runner (%s)", self.where, config.model_dir)

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        logger.info("%s: %s (+%.1f s)", self.where, what, now - self.last)
        self.last = now
