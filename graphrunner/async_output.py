"""Asynchronous step outputs: sampled ids travel to the host on a side stream, behind an event.

`launch()` returns at once; `AsyncStepOutput.result()` waits only for that step's copy, which the
engine calls after it has already launched the next step. On CPU the structure is the same and
the wait is trivial.
"""

from __future__ import annotations

import torch


class AsyncStepOutput:
    """Host copy of one step's sampled ids, valid once `result()` returns."""

    def __init__(self, sampled_host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self._sampled_host = sampled_host  # [B] int32 (pinned on CUDA)
        self._event = event

    def result(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._sampled_host.tolist()


class OutputCopier:
    """Issues the D2H copy of each step's sampled ids on a dedicated stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def launch(self, sampled: torch.Tensor) -> AsyncStepOutput:
        """sampled [B] int32 on the device -> an output whose value is read later."""
        if self._stream is None:
            return AsyncStepOutput(sampled.clone(), None)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(sampled, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        sampled.record_stream(self._stream)  # keep the device buffer alive until the copy has read it
        return AsyncStepOutput(host, event)
