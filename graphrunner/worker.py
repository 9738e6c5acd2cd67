"""Building the device side of an engine: model, KV cache sized to free memory, state table, runner.

On CUDA the KV cache takes what a profiling forward of the largest step leaves free under
gpu_memory_utilization; on CPU it is capped so a laptop is not asked for gigabytes.
"""

from __future__ import annotations

import torch

from graphrunner.config import EngineConfig
from graphrunner.kv_cache import allocate_kv_cache, blocks_needed, kv_bytes_per_block
from graphrunner.loader import load_model
from graphrunner.runner import ModelRunner
from graphrunner.state_table import StateTable

CPU_KV_CAP_BYTES = 256 << 20  # a laptop-sized default; num_gpu_blocks_override raises it


def _profile_peak_bytes(model: torch.nn.Module, config: EngineConfig) -> int:
    """Peak CUDA memory of a forward over max_num_batched_tokens tokens (one prefill, nothing written)."""
    from graphrunner.attention import AttentionMetadata, forward_context

    sc, bs = config.scheduler, config.cache.block_size
    t = min(sc.max_num_batched_tokens, sc.max_model_len)
    dev = config.device
    torch.cuda.reset_peak_memory_stats(dev)
    kv = allocate_kv_cache(config.model, 2, bs, config.dtype, dev)
    meta = AttentionMetadata(
        num_reqs=1, num_tokens=t, max_query_len=t, max_seq_len=t, block_size=bs,
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
        block_table=torch.zeros(1, blocks_needed(t, bs), dtype=torch.int32, device=dev),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
        query_lens_cpu=[t], seq_lens_cpu=[t],
    )
    with torch.inference_mode(), forward_context(meta, kv):
        hidden = model(torch.zeros(t, dtype=torch.int64, device=dev), torch.arange(t, device=dev))
        model.compute_logits(hidden[: sc.max_num_seqs])
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    del kv, hidden
    torch.cuda.empty_cache()
    return peak


def choose_num_blocks(model: torch.nn.Module, config: EngineConfig) -> int:
    cache, sc = config.cache, config.scheduler
    per_block = kv_bytes_per_block(config.model, cache.block_size, config.dtype)
    if cache.num_blocks is not None:
        return cache.num_blocks
    want = sc.max_num_seqs * blocks_needed(sc.max_model_len, cache.block_size) + 1
    if config.device.type != "cuda":
        return max(2, min(want, CPU_KV_CAP_BYTES // per_block))
    peak = _profile_peak_bytes(model, config)
    _, total = torch.cuda.mem_get_info(config.device)
    budget = int(total * cache.gpu_memory_utilization) - peak
    num = min(want, budget // per_block)
    if num < 2:
        raise ValueError(f"no memory left for the KV cache: model + activations take {peak / 2**30:.1f} GiB of "
                         f"{total * cache.gpu_memory_utilization / 2**30:.1f} GiB; raise gpu_memory_utilization")
    return num


def build_runner(config: EngineConfig) -> tuple[ModelRunner, int]:
    """Load the model and allocate everything the runner needs; returns (runner, num KV blocks)."""
    model = load_model(config.model_dir, config.model, config.dtype, config.device)
    num_blocks = choose_num_blocks(model, config)
    if config.compile_cache is not None:
        from capture.compiled import prepare_compiled_model  # capture builds on graphrunner: import late

        model = prepare_compiled_model(model, config)
    kv = allocate_kv_cache(config.model, num_blocks, config.cache.block_size, config.dtype, config.device)
    sc = config.scheduler
    state = StateTable(sc.max_num_seqs, sc.max_model_len, blocks_needed(sc.max_model_len, config.cache.block_size),
                       config.device, config.use_triton)
    runner = ModelRunner(model, kv, state, config.cache.block_size, config.use_triton, config.logprobs_mode,
                         config.attention_backend)
    return runner, num_blocks
