"""The capture manager: captures FULL decode graphs and PIECEWISE piece graphs, largest first, into
one shared memory pool, and tells the runner per step which of them to use (a GraphDispatcher).

It is handed what it records (the ModelState for shapes and dummy inputs, the step buffers, and the
step bodies at capture time) and never holds the runner.

FULL graphs are keyed by (padded batch size, KV splits, tokens per request): long contexts at small
batches need the split-KV attention, whose grid must be fixed when the graph is captured; a
speculative engine has plain decode graphs (1 token a request) and verify graphs (1 + k).
"""

from __future__ import annotations

import bisect
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from capture import cuda_piece
from capture.cuda_piece import GraphPiece, fast_capture, piecewise_graphs, weak_alias
from graphrunner.attention.triton_attention import choose_num_splits
from graphrunner.input_prep import StepBuffers
from graphrunner.step_plan import StepBodies, StepMode, StepPlan
from model_states.base import ModelState


class CaptureManager:
    """Owns every CUDA graph of one runner; implements graphrunner.step_plan.GraphDispatcher."""

    def __init__(self, model_state: ModelState, buffers: StepBuffers, pieces: list[GraphPiece] | None,
                 full_sizes: list[int], token_sizes: list[int], max_model_len: int) -> None:
        self.model_state = model_state
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.pieces = pieces  # None: the model is not compiled into pieces, so no PIECEWISE mode
        self.num_kv_heads = model_state.config.num_kv_heads
        self.full_sizes = sorted(full_sizes)  # empty: no FULL graphs
        self.token_sizes = sorted(token_sizes) if pieces is not None else []
        self.pool: Any = None  # the shared graph memory pool, made at the first capture
        self._full: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.query_lens = model_state.full_query_lens  # tokens per request of the FULL graphs
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.mode_counts: Counter[StepMode] = Counter()  # steps planned per mode (tests and benchmarks read it)

    # -- dispatch ----------------------------------------------------------------------------
    def _long_splits(self, num_reqs: int) -> int:
        return choose_num_splits(num_reqs, self.num_kv_heads, self.max_model_len)

    def full_keys(self) -> list[tuple[int, int]]:
        keys = [(p, 1) for p in self.full_sizes]
        keys += [(p, s) for p in self.full_sizes if (s := self._long_splits(p)) > 1]
        return sorted(keys, reverse=True)  # largest first: smaller graphs reuse the pool's blocks

    def plan(self, num_reqs: int, num_tokens: int, max_seq_len: int, full_ok: bool,
             query_len: int | None = None) -> StepPlan:
        plan = self._plan(num_reqs, num_tokens, max_seq_len, full_ok, query_len)
        self.mode_counts[plan.mode] += 1
        return plan

    def _plan(self, num_reqs: int, num_tokens: int, max_seq_len: int, full_ok: bool,
              query_len: int | None) -> StepPlan:
        q = self.model_state.uniform_query_len if query_len is None else query_len
        if full_ok and q in self.query_lens and self.full_sizes and num_reqs <= self.full_sizes[-1]:
            p = self.full_sizes[bisect.bisect_left(self.full_sizes, num_reqs)]
            want = choose_num_splits(p, self.num_kv_heads, max_seq_len)
            return StepPlan(StepMode.FULL, p, p * q, self._long_splits(p) if want > 1 else 1, q)
        if self.token_sizes and 0 < num_tokens <= self.token_sizes[-1]:
            return StepPlan(StepMode.PIECEWISE, num_reqs,
                            self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)])
        return StepPlan(StepMode.EAGER, num_reqs, num_tokens)

    def forward_mode(self, plan: StepPlan) -> Any:
        if plan.mode is StepMode.PIECEWISE:
            return piecewise_graphs(plan.num_tokens, self.pool)
        return nullcontext()

    def replay_full(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        graph, outputs = self._full[(plan.num_reqs, plan.num_splits, plan.query_len)]
        graph.replay()
        return outputs

    # -- capture -----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, bodies: StepBodies, largest_only: bool = False, progress: bool = True) -> None:
        """Warm up and capture every size (or only the largest of each kind, to measure the pool)."""
        token_sizes = sorted(self.token_sizes, reverse=True)
        full_keys = self.full_keys()
        if largest_only:
            token_sizes = token_sizes[:1]
            full_keys = [k for k in full_keys if k[0] == full_keys[0][0]] if full_keys else []
        # Graphs of an earlier capture (the measuring one) stay alive until this one is done: a pool
        # whose last graph dies is freed, and capturing into its handle afterwards is an error.
        retired = self.retire()
        on_gpu = self.buffers.step_rows.device.type == "cuda"  # (tests drive the same flow on CPU with recorded "graphs")
        if self.pool is None and on_gpu:
            self.pool = torch.cuda.graph_pool_handle()
        free_before = _free_bytes() if on_gpu else 0
        start = time.perf_counter()
        full_keys = [(p, s, q) for q in sorted(self.query_lens, reverse=True) for p, s in full_keys]
        with _progress(len(token_sizes) + len(full_keys), progress and not largest_only) as bar, fast_capture():
            for size in token_sizes:
                inputs, shape = self.model_state.dummy_inputs(self.buffers, size)
                bodies.forward(inputs, shape)  # warm-up: Dynamo variants, Triton autotuning, cuBLAS handles
                with piecewise_graphs(size, self.pool, capture=True):
                    bodies.forward(inputs, shape)
                bar(f"piecewise {size} tokens")
            for num_reqs, splits, q in full_keys:
                self.buffers.fill_padding_rows(num_reqs)
                bodies.full_decode(num_reqs, splits, q)
                graph, outputs = cuda_piece._record(bodies.full_decode, (num_reqs, splits, q), self.pool)
                self._full[(num_reqs, splits, q)] = (graph, tuple(weak_alias(o) for o in outputs))
                bar(f"full {'verify' if q > 1 else 'decode'} {num_reqs} x{splits}")
        self.capture_seconds = time.perf_counter() - start
        del retired
        if on_gpu:
            self.pool_bytes += max(0, free_before - _free_bytes())  # what the pool grew by

    def retire(self) -> list[Any]:
        """Detach every graph from dispatch and hand them back (dropping the list destroys them)."""
        old: list[Any] = [self._full]
        self._full = {}
        for piece in self.pieces or []:
            old.append(piece.graphs)
            piece.graphs = {}
        return old

    @property
    def num_graphs(self) -> int:
        return len(self._full) + sum(len(p.graphs) for p in self.pieces or [])


def _free_bytes() -> int:
    """Free device memory once the ordinary allocator's cache is returned (the graph pool keeps its blocks)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@contextmanager
def _progress(total: int, show: bool) -> Iterator[Any]:
    """A tqdm bar on stderr when available (and wanted); a no-op callback otherwise."""
    bar = None
    if show and total:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="capturing CUDA graphs", file=sys.stderr, leave=False)
        except ImportError:
            bar = None

    def step(label: str) -> None:
        if bar is not None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

    try:
        yield step
    finally:
        if bar is not None:
            bar.close()
