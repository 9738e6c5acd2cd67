"""Host time vs device time per engine step, for benchmarks: is a run host-bound or device-bound?

`StepTimer(llm)` wraps the engine's `step()` (host wall time), `AsyncStepOutput.result()` (time the host spent
waiting for a step's outputs) and the runner's `execute()` (CUDA events around the launched work, which time
the device's work on the step whether or not the device was idle before it). Benchmark-only instrumentation:
it patches one engine instance and the AsyncStepOutput class, and `close()` undoes both.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from graphrunner.async_output import AsyncStepOutput


class StepTimer:
    def __init__(self, llm: Any) -> None:
        self.engine = llm.engine
        self.host_s: list[float] = []      # wall time of each engine.step(), waits included
        self.wait_s: list[float] = []      # time inside AsyncStepOutput.result()
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._orig_step = self.engine.step
        self._orig_execute = self.engine.runner.execute
        self._orig_result = AsyncStepOutput.result
        cuda = self.engine.config.device.type == "cuda"
        timer = self

        def step() -> Any:
            t0 = time.perf_counter()
            try:
                return timer._orig_step()
            finally:
                timer.host_s.append(time.perf_counter() - t0)

        def execute(sched: Any) -> Any:
            if not cuda:
                return timer._orig_execute(sched)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = timer._orig_execute(sched)
            end.record()
            timer._events.append((start, end))
            return out

        def result(self_: AsyncStepOutput) -> Any:
            t0 = time.perf_counter()
            try:
                return timer._orig_result(self_)
            finally:
                timer.wait_s.append(time.perf_counter() - t0)

        self.engine.step = step
        self.engine.runner.execute = execute
        AsyncStepOutput.result = result  # type: ignore[method-assign]

    def reset(self) -> None:
        self.host_s.clear()
        self.wait_s.clear()
        self._events.clear()

    def summary(self) -> dict[str, float | int | None]:
        """Means in ms per step: host (busy, without waits), wait, device (None on CPU)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        device_ms = [s.elapsed_time(e) for s, e in self._events]
        steps = len(self.host_s)
        host_busy = (sum(self.host_s) - sum(self.wait_s)) / max(1, steps) * 1e3
        return {"steps": steps, "host_busy_ms": host_busy,
                "host_wait_ms": sum(self.wait_s) / max(1, steps) * 1e3,
                "device_ms": statistics.fmean(device_ms) if device_ms else None,
                "device_p50_ms": statistics.median(device_ms) if device_ms else None}

    def close(self) -> None:
        self.engine.step = self._orig_step
        self.engine.runner.execute = self._orig_execute
        AsyncStepOutput.result = self._orig_result  # type: ignore[method-assign]


def describe(s: dict[str, Any]) -> str:
    dev = f"{s['device_ms']:.3f}" if s.get("device_ms") is not None else "n/a"
    bound = ""
    if s.get("device_ms") is not None:
        bound = " (host-bound)" if s["host_busy_ms"] > s["device_ms"] else " (device-bound)"
    return (f"{s['steps']} steps: host busy {s['host_busy_ms']:.3f} ms/step, waiting {s['host_wait_ms']:.3f} "
            f"ms/step, device {dev} ms/step{bound}")
