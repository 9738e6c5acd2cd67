"""A step's results, typed (StepOutput), and their asynchronous trip to the host: the tensors are
copied on a side stream behind an event.

`launch()` returns at once; `AsyncStepOutput.result()` waits only for that step's copies, which the
engine calls after it has already launched the next step. On CPU the structure is the same and
the wait is trivial. Every step mode (eager, PIECEWISE, FULL) hands over the same StepOutput.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphrunner.sampling.logprobs import LogprobsTensors


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Prompt positions of one request whose logprobs a step computed (rows of prompt_logprobs)."""

    parent_id: str
    first: int   # first prompt position in this step; position p predicts prompt token p + 1
    count: int


@dataclass(frozen=True)
class SpecTensors:
    """A verify step's extra results (speculative decoding): request b emitted output_ids[b, :num_accepted + 1]."""

    output_ids: torch.Tensor    # [B, K + 1] int32, -1 unused
    num_accepted: torch.Tensor  # [B] int32
    num_drafts: torch.Tensor    # [B] int32 drafts verified
    first_row: tuple[int, ...] = ()  # logits row (of logprobs) of each request's first emitted token


@dataclass(frozen=True)
class StepOutput:
    """What one step produced, from the runner to the output processor (device or host tensors)."""

    sampled: torch.Tensor                       # [B] int32
    nonfinite: torch.Tensor                     # [B] bool: the row's raw logits held NaN or inf
    logprobs: LogprobsTensors | None = None     # [B, ...] for the sampled tokens, when any request asked
    prompt_logprobs: LogprobsTensors | None = None  # [P, ...], the spans' positions one after another
    prompt_logprob_spans: tuple[PromptLogprobSpan, ...] = ()
    spec: SpecTensors | None = None             # verify steps only; `sampled` is then output_ids[:, 0]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> StepOutput:
        """The same output with fn applied to every tensor (a copy to the host, a clone)."""
        def lp(t: LogprobsTensors | None) -> LogprobsTensors | None:
            if t is None:
                return None
            return LogprobsTensors(**{f.name: fn(getattr(t, f.name)) for f in dataclasses.fields(t)})

        spec = None
        if self.spec is not None:
            sp = self.spec
            spec = SpecTensors(fn(sp.output_ids), fn(sp.num_accepted), fn(sp.num_drafts), sp.first_row)
        return StepOutput(fn(self.sampled), fn(self.nonfinite), lp(self.logprobs), lp(self.prompt_logprobs),
                          self.prompt_logprob_spans, spec)

    def tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            found.append(t)
            return t

        self.map_tensors(keep)
        return found


class AsyncStepOutput:
    """Host copies of one step's results, valid once `result()` returns."""

    def __init__(self, host: StepOutput, event: torch.cuda.Event | None) -> None:
        self._host = host  # pinned on CUDA
        self._event = event

    def ready(self) -> bool:
        """Whether result() would return without waiting."""
        return self._event is None or self._event.query()

    def result(self) -> StepOutput:
        if self._event is not None:
            self._event.synchronize()
        return self._host


class OutputCopier:
    """Issues the D2H copies of each step's results on a dedicated stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def launch(self, out: StepOutput) -> AsyncStepOutput:
        """Device tensors -> an output whose values are read later (the device buffers stay alive)."""
        if self._stream is None:
            return AsyncStepOutput(out.map_tensors(torch.Tensor.clone), None)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host = out.map_tensors(_to_pinned)
            event = torch.cuda.Event()
            event.record(self._stream)
        for v in out.tensors():
            v.record_stream(self._stream)  # keep each device buffer alive until the copy has read it
        return AsyncStepOutput(host, event)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
