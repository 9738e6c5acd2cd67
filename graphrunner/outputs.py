"""User-facing results: RequestOutput and CompletionOutput, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphrunner.metrics import RequestMetrics


@dataclass
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenDeltas:
    """A step's new token ids for many requests at once, as parallel lists: the report of every request whose
    report is only that (one completion, neither its first report nor its last, no logprobs, no text made by the
    engine: an AsyncLLM request). Building a RequestOutput for each of 256 requests every step costs more host
    time than the rest of the step's output processing; the front appends these ids to its streams."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None  # arrival, first scheduled / first token / last token / finished times
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
