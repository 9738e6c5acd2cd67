"""Asynchronous step outputs: a step's result tensors travel to the host on a side stream, behind
an event.

`launch()` returns at once; `AsyncStepOutput.result()` waits only for that step's copies, which the
engine calls after it has already launched the next step. On CPU the structure is the same and
the wait is trivial.
"""

from __future__ import annotations

import torch


class AsyncStepOutput:
    """Host copies of one step's result tensors, valid once `result()` returns."""

    def __init__(self, host: dict[str, torch.Tensor], event: torch.cuda.Event | None,
                 info: dict[str, object] | None = None) -> None:
        self._host = host  # pinned on CUDA
        self._event = event
        self.info = info or {}  # host-side facts about the step the reader needs (no waiting involved)

    def result(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


class OutputCopier:
    """Issues the D2H copies of each step's results on a dedicated stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def launch(self, tensors: dict[str, torch.Tensor], info: dict[str, object] | None = None) -> AsyncStepOutput:
        """Device tensors -> an output whose values are read later (the device buffers stay alive)."""
        if self._stream is None:
            return AsyncStepOutput({k: v.clone() for k, v in tensors.items()}, None, info)
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in tensors.items()}
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for k, v in tensors.items():
                host[k].copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        for v in tensors.values():
            v.record_stream(self._stream)  # keep each device buffer alive until the copy has read it
        return AsyncStepOutput(host, event, info)
