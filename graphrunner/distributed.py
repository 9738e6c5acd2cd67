"""vLLM's distributed clean-up helpers, for scripts that call them between engines. One process drives one
device here, so there is no process group to destroy: they release cached device memory and nothing else."""

from __future__ import annotations

import gc

import torch


def destroy_model_parallel() -> None:
    """No model-parallel groups exist (tensor parallelism is not built yet)."""


def destroy_distributed_environment() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """After `del llm`: collect the engine's objects and return cached device memory (as vLLM's helper does)."""
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
