"""The engine's internal Request: one sequence being generated, as the scheduler tracks it.

A user request with n > 1 becomes n Requests (one per completion) that share a parent id.
Token values arrive one step late (async outputs): `num_inflight` counts tokens sampled on the
device whose values the host has not seen yet.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from graphrunner.prefix_cache import BlockHash
from graphrunner.sampling.batch import RequestSampling
from graphrunner.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    parent_id: str
    index: int                      # completion index within the parent (0..n-1)
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                       # resolved RNG seed (drawn at admission when params.seed is None)
    max_tokens: int                 # resolved from params.max_tokens / max_model_len
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0    # host view: tokens whose KV is (or will be, once launched) cached
    num_inflight: int = 0           # sampled on the device, value not yet seen by the host
    # speculative decoding: draft tokens scheduled in steps still in flight. Each may be accepted (one more output
    # token) or rejected (num_computed_tokens, an upper bound while drafts are in flight, drops by one)
    num_spec_inflight: int = 0
    # the first position whose KV a model proposer (draft model, EAGLE head) lacks, because the request ran in a
    # step with speculation off by batch size (the proposer did not run); None: its proposer KV is complete. Such
    # a request gets no draft slots again (until a preemption recomputes it)
    proposer_gap: int | None = None
    row: int = -1                   # state-table row while it holds one
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampling: RequestSampling = field(default_factory=RequestSampling)  # token-level sampling data
    cache_salt: str | None = None   # extra prefix-cache key: only requests with the same salt share blocks
    block_hashes: list[BlockHash] = field(default_factory=list)  # prefix keys of its full, known blocks
    num_registered_blocks: int = 0  # leading blocks of block_ids already registered in the prefix cache
    num_cached_tokens: int = -1     # prompt tokens served from the prefix cache at first admission (-1: not yet)
    _prompt_array: array | None = field(default=None, init=False, repr=False)  # int32 copy, made on first use

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt + outputs, counting tokens still in flight (their values live on the device)."""
        return self.prompt_len + len(self.output_token_ids) + self.num_inflight

    @property
    def num_host_tokens(self) -> int:
        """Prompt + outputs whose values the host has seen."""
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens including in-flight samples; a lower bound while drafts are in flight."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def num_generated_upper(self) -> int:
        """Output tokens if every in-flight draft is accepted."""
        return len(self.output_token_ids) + self.num_inflight + self.num_spec_inflight

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_array(self, start: int, end: int) -> array:
        """Tokens [start, end) of prompt + outputs as an int32 array: the prompt is converted once per request, so
        its keys and every staging of its row copy memory instead of converting 4K Python ints each time."""
        if self._prompt_array is None:
            self._prompt_array = array("i", self.prompt_token_ids)
        n = self.prompt_len
        head = self._prompt_array[start:min(end, n)] if start < n else array("i")
        if end > n:
            head.extend(self.output_token_ids[max(start - n, 0):end - n])
        return head
