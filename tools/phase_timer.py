"""Host wall time per engine phase of one call (benchmark-only instrumentation), to see where a request's
latency goes outside the device: intake, scheduling, staging, the launch, the wait for the device, output processing.

`PhaseTimer(llm)` wraps a fixed set of methods of one engine instance (and AsyncStepOutput.result); after each
measured call `end_call(wall_s)` closes its phase sums, `medians_ms()` / `table()` give the medians over the calls
since the last `reset()`; `close()` undoes the patches. Nested phases overlap
(`execute` holds `stage`; `process` holds `wait`): the table names them so.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

from graphrunner.async_output import AsyncStepOutput

# (label, path of the object from the engine, method name): what each phase times
# (indented labels are parts of the phase above them, left out of the "outside the phases" sum)
PHASES: tuple[tuple[str, str, str], ...] = (
    ("add_request", "", "add_request"),
    ("schedule", "scheduler", "schedule"),
    ("  cache lookup", "scheduler", "_cache_hits"),
    ("execute (launch)", "runner", "execute"),
    ("  stage", "runner", "_stage"),
    ("    apply_staged", "runner.state", "apply_staged"),
    ("  FULL replay", "runner", "_replay_full"),
    ("  launch output copy", "runner.outputs", "launch"),
    ("process (wait incl.)", "", "_process"),
)


class PhaseTimer:
    def __init__(self, llm: Any) -> None:
        self.engine = llm.engine
        self.totals: dict[str, float] = defaultdict(float)
        self._calls: list[dict[str, float]] = []
        self._undo: list[tuple[Any, str, Any]] = []
        for label, path, name in PHASES:
            owner = self.engine
            for part in filter(None, path.split(".")):
                owner = getattr(owner, part)
            self._wrap(owner, name, label)
        original_result = AsyncStepOutput.result
        timer = self

        def result(self_: AsyncStepOutput) -> Any:
            t0 = time.perf_counter()
            try:
                return original_result(self_)
            finally:
                timer.totals["  wait (device)"] += time.perf_counter() - t0

        AsyncStepOutput.result = result  # type: ignore[method-assign]
        self._undo.append((AsyncStepOutput, "result", original_result))

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        had_own = name in vars(owner)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, original if had_own else None))

    def end_call(self, wall_s: float) -> None:
        """Close one measured call of `wall_s` seconds: its phase sums join calls()."""
        row = dict(self.totals)
        row["total"] = wall_s
        row["outside the phases"] = wall_s - sum(v for k, v in row.items() if k != "total" and not k.startswith(" "))
        self._calls.append(row)
        self.totals.clear()

    def reset(self) -> None:
        self.totals.clear()
        self._calls.clear()

    def medians_ms(self) -> dict[str, float]:
        keys = [label for label, _, _ in PHASES] + ["  wait (device)", "outside the phases", "total"]
        return {k: statistics.median(c.get(k, 0.0) for c in self._calls) * 1e3 for k in keys if self._calls}

    def table(self, title: str) -> str:
        lines = [f"--- {title}: host phases, median ms per call over {len(self._calls)} calls"]
        lines += [f"  {k:<24} {v:8.3f}" for k, v in self.medians_ms().items()]
        return "\n".join(lines)

    def close(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()
