"""How one step runs and what shape it has: eagerly, through piecewise CUDA graphs, or as one FULL
graph replay (StepPlan), and the host-side counts its attention metadata is built from (StepShape).

The runner asks a GraphDispatcher (capture/manager.py implements it) for a StepPlan and follows
it; the plan's sizes are the padded ones the graphs were captured for.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from graphrunner.input_prep import StepInputs


class StepMode(enum.Enum):
    EAGER = "eager"          # compiled or plain model, no graphs; exact sizes
    PIECEWISE = "piecewise"  # compiled pieces replay graphs captured for num_tokens; attention eager
    FULL = "full"            # one replay: prepare + forward + sample + post-update for num_reqs rows
    #                          (a uniform decode, or, with `mixed`, any batch of up to num_tokens tokens)


@dataclass(frozen=True)
class StepPlan:
    mode: StepMode
    num_reqs: int       # requests, padded up to a captured size in FULL mode
    num_tokens: int     # tokens, padded up to a captured size in PIECEWISE and FULL modes
    num_splits: int = 1  # FULL: the KV split count its graph was captured with
    mixed: bool = False  # FULL: a graph for any query lengths (prefill chunks included), not a uniform decode


@dataclass(frozen=True)
class StepShape:
    """Host-side counts of one forward, known before launch (nothing is read back from the device).

    A FULL graph's shape cannot follow the batch's lengths: it says max_model_len for every row and
    fixes num_splits; eager and piecewise steps give the exact lengths and let the backend choose."""

    num_reqs: int
    num_tokens: int                 # padding included
    query_lens: tuple[int, ...]     # len num_reqs
    seq_lens: tuple[int, ...]       # len num_reqs, context including this step's tokens
    num_splits: int | None = None   # split-KV count fixed at capture (FULL); None = backend's choice

    def __post_init__(self) -> None:
        if len(self.query_lens) != self.num_reqs or len(self.seq_lens) != self.num_reqs:
            raise ValueError(f"a step of {self.num_reqs} requests needs as many query and sequence lengths, "
                             f"got {len(self.query_lens)} and {len(self.seq_lens)}")
        if sum(self.query_lens) > self.num_tokens:
            raise ValueError(f"{sum(self.query_lens)} query tokens do not fit a step of {self.num_tokens} tokens")


class GraphDispatcher(Protocol):
    def plan(self, num_reqs: int, num_tokens: int, max_seq_len: int, full_ok: bool,
             mixed_ok: bool = False, query_len: int | None = None, full_max_reqs: int | None = None) -> StepPlan:
        """full_ok: the batch is a uniform decode (query_len tokens a request; None = the ModelState's
        uniform_query_len) whose sampling the FULL graph covers; mixed_ok: a FULL graph covers its sampling,
        whatever its query lengths (a mixed FULL graph may serve it); full_max_reqs: the largest padded batch
        whose uniform FULL graph does what this step needs (None: any)."""

    def forward_mode(self, plan: StepPlan) -> AbstractContextManager[None]:
        """Context for a non-FULL forward (piecewise replay when the plan says so)."""

    def replay_full(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """Replay the FULL graph; returns its output buffers, those of StepBodies.full_step."""


@dataclass(frozen=True)
class StepBodies:
    """What capture records, handed over as arguments (capture never holds the runner)."""

    # the model over prepared inputs, attention context set: returns hidden states [T, hidden]
    forward: Callable[[StepInputs, StepShape], torch.Tensor]
    # prepare..update over the first P step rows and T tokens with a fixed KV split count, for a uniform
    # decode (mixed False, T = P * query len) or any query lengths (mixed True):
    # (num_reqs P, num_tokens T, num_splits, mixed) -> (sampled [P] int32, nonfinite [P] bool); a speculative
    # engine's verify graph (T = P * (1 + k)) adds (output_ids [P, K + 1] int32, num_accepted [P] int32,
    # num_drafts [P] int32)
    full_step: Callable[[int, int, int, bool], tuple[torch.Tensor, ...]]
