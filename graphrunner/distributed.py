"""vLLM's distributed clean-up helpers, for scripts that call them between engines: they leave the
tensor-parallel process group (graphrunner.parallel_state) and release cached device memory."""

from __future__ import annotations

import gc

import torch

from graphrunner.parallel_state import destroy_tensor_parallel


def destroy_model_parallel() -> None:
    """Leave the tensor-parallel group of this process, if any (a dropped engine's workers stop when it is
    collected)."""
    destroy_tensor_parallel()


def destroy_distributed_environment() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """After `del llm`: collect the engine's objects (which stops its workers), leave the process group and
    return cached device memory (as vLLM's helper does)."""
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
