"""How one step runs: eagerly, through piecewise CUDA graphs, or as one FULL graph replay.

The runner asks a GraphDispatcher (capture/manager.py implements it) for a StepPlan and follows
it; the plan's sizes are the padded ones the graphs were captured for.
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch


class StepMode(enum.Enum):
    EAGER = "eager"          # compiled or plain model, no graphs; exact sizes
    PIECEWISE = "piecewise"  # compiled pieces replay graphs captured for num_tokens; attention eager
    FULL = "full"            # one replay: prepare + forward + sample + post-update for num_reqs rows


@dataclass(frozen=True)
class StepPlan:
    mode: StepMode
    num_reqs: int       # requests, padded up to a captured size in FULL mode
    num_tokens: int     # tokens, padded up to a captured size in PIECEWISE and FULL modes
    num_splits: int = 1  # FULL: the KV split count its graph was captured with


class GraphDispatcher(Protocol):
    def plan(self, num_reqs: int, num_tokens: int, max_seq_len: int, full_ok: bool) -> StepPlan:
        """full_ok: the batch is a uniform decode whose sampling the FULL graph covers."""

    def forward_mode(self, plan: StepPlan) -> AbstractContextManager[None]:
        """Context for a non-FULL forward (piecewise replay when the plan says so)."""

    def replay_full(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the FULL graph; returns its (sampled [P] int32, nonfinite [P] bool) buffers."""
