"""Argument checks shared by the public launchers of the Triton kernels (shape, dtype, device), the device
facts their launch shapes depend on, which of their arguments Triton must not specialise on, and the zeroed
arrival counters of the kernels whose last program reduces (split-K GEMV, split sampler, folded attention merge).

They look only at tensor metadata, never at values, so they cost no host synchronisation.
"""

from __future__ import annotations

import functools
import os

import torch


def check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype | tuple[torch.dtype, ...] | None, ndim: int,
                 device: torch.device | None) -> None:
    """Raise ValueError naming `name` when t's dtype (None: any), rank or device (None: any) is wrong."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if dtype is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter: a few programs per row, so
    tests cover the multi-program reductions)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def int32_aligned(n: int) -> int:
    """n int32 entries rounded up to a 16-byte boundary: where the next view of a packed int32 buffer may start
    without giving Triton a new pointer alignment to specialise on (per-step views must keep one alignment)."""
    return -(-n // 4) * 4


def step_sizes(*names: str) -> list[str]:
    """Arguments of a per-step kernel that follow the batch (token and request counts, chunking): Triton would
    compile a variant for each value that is 1 or divisible by 16, mid-run, so they are not specialised on
    (docs/DECISIONS.md). GRAPHRUNNER_TRITON_SPECIALISE=1 restores Triton's default, for an A/B of the lost hints."""
    return [] if os.environ.get("GRAPHRUNNER_TRITON_SPECIALISE") == "1" else list(names)


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1: CPU tensors, one program at a time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def zeroed_counters(cache: dict[torch.device, torch.Tensor], device: torch.device, size: int) -> torch.Tensor | None:
    """cache[device]: [size] int32 zeros, allocated on first use, for kernels whose last-arriving program takes a
    ticket and zeroes it again (so every launch and graph replay finds zeros). None while a CUDA graph is being
    captured and none exists yet: never allocate there (the caller launches its fallback instead)."""
    buf = cache.get(device)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = cache[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf
