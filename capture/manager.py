"""The capture manager: captures FULL decode graphs and PIECEWISE piece graphs, largest first, into
one shared memory pool, and tells the runner per step which of them to use (a GraphDispatcher).

It is handed what it records (the ModelState for shapes and dummy inputs, the step buffers, and the
step bodies at capture time) and never holds the runner.

FULL graphs are keyed by (padded batch size, padded tokens, KV splits, mixed): long contexts at small
batches need the split-KV attention, whose grid must be fixed when the graph is captured. Uniform decodes
have graphs per batch size; small batches with prefill chunks (a new request's prompt, a cache hit's
suffix) have mixed graphs per (batch size, token bucket), so a short prefill costs one replay instead of
a piecewise step's per-layer attention launches from the host. A speculative engine's uniform graphs
come in two query lengths (the ModelState's `full_query_lens`): plain decodes (1 token a request) and
verify steps (1 + k); their token counts tell them apart.
"""

from __future__ import annotations

import bisect
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from capture import cuda_piece
from capture.cuda_piece import GraphPiece, fast_capture, piecewise_graphs, weak_alias
from graphrunner.attention.triton_attention import choose_num_splits, query_tiles
from graphrunner.input_prep import StepBuffers
from graphrunner.models.gemv import MAX_M as SMALL_M_TOKENS
from graphrunner.step_plan import StepBodies, StepMode, StepPlan
from model_states.base import ModelState

logger = logging.getLogger(__name__)

FullKey = tuple[int, int, int, bool]  # (batch size, tokens, KV splits, mixed)


class CaptureManager:
    """Owns every CUDA graph of one runner; implements graphrunner.step_plan.GraphDispatcher."""

    def __init__(self, model_state: ModelState, buffers: StepBuffers, pieces: list[GraphPiece] | None,
                 full_sizes: list[int], token_sizes: list[int], max_model_len: int,
                 mixed_sizes: list[tuple[int, int]] | None = None) -> None:
        self.model_state = model_state
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.pieces = pieces  # None: the model is not compiled into pieces, so no PIECEWISE mode
        self.num_kv_heads = model_state.config.num_kv_heads
        self.full_sizes = sorted(full_sizes)  # empty: no FULL graphs
        self.token_sizes = sorted(token_sizes) if pieces is not None else []
        self.mixed_sizes = sorted(mixed_sizes or [])  # (batch size, tokens) of mixed FULL graphs; empty: none
        self.pool: Any = None  # the shared graph memory pool, made at the first capture
        self._full: dict[FullKey, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0
        self.piecewise_capture_seconds = 0.0  # the part of capture_seconds spent on piecewise buckets
        self.full_warmup_seconds = 0.0  # the part spent in the FULL graphs' warm-up steps (before each record)
        self.mode_counts: Counter[StepMode] = Counter()  # steps planned per mode (tests and benchmarks read it)
        self.mixed_steps = 0  # FULL steps that used a mixed graph

    # -- dispatch ----------------------------------------------------------------------------
    def _long_splits(self, num_reqs: int, max_query_len: int = 1, max_seq_len: int | None = None) -> int:
        """KV splits the attention grid of this shape gets at max_seq_len (default: the longest context)."""
        tiles = num_reqs * query_tiles(max_query_len, self.model_state.config.num_heads // self.num_kv_heads)
        return choose_num_splits(tiles, self.num_kv_heads, self.max_model_len if max_seq_len is None else max_seq_len)

    def full_keys(self) -> list[FullKey]:
        """(batch size, tokens, KV splits, mixed) of every FULL graph, largest first (smaller graphs reuse
        the pool's blocks). A mixed graph has one split count, the one its longest context needs: with a
        short context the extra splits find no keys and cost one small merge."""
        keys: list[FullKey] = []
        for q in self.model_state.full_query_lens:
            keys += [(p, p * q, 1, False) for p in self.full_sizes]
            keys += [(p, p * q, s, False) for p in self.full_sizes if (s := self._long_splits(p, q)) > 1]
        keys += [(p, t, self._long_splits(p, t), True) for p, t in self.mixed_sizes]
        return sorted(keys, key=lambda k: (k[1], k[0], k[2]), reverse=True)

    def plan(self, num_reqs: int, num_tokens: int, max_seq_len: int, full_ok: bool,
             mixed_ok: bool = False, query_len: int | None = None, full_max_reqs: int | None = None) -> StepPlan:
        plan = self._plan(num_reqs, num_tokens, max_seq_len, full_ok, mixed_ok, query_len, full_max_reqs)
        self.mode_counts[plan.mode] += 1
        self.mixed_steps += plan.mixed
        return plan

    def _plan(self, num_reqs: int, num_tokens: int, max_seq_len: int, full_ok: bool, mixed_ok: bool,
              query_len: int | None, full_max_reqs: int | None) -> StepPlan:
        q = self.model_state.uniform_query_len if query_len is None else query_len
        p = (self.full_sizes[bisect.bisect_left(self.full_sizes, num_reqs)]
             if self.full_sizes and num_reqs <= self.full_sizes[-1] else None)
        if (full_ok and q in self.model_state.full_query_lens and p is not None
                and (full_max_reqs is None or p <= full_max_reqs)):
            want = self._long_splits(p, q, max_seq_len)  # the same tiles as the captured graphs count
            return StepPlan(StepMode.FULL, p, p * q, self._long_splits(p, q) if want > 1 else 1)
        # A step of <= MAX_M tokens takes only a mixed graph of the size its piecewise bucket pads it to (the next
        # power of two): padded further (into 64 tokens) its linears would leave the small-M GEMV, or cross a
        # weight's GEMV limit, and its bits would differ from eager's.
        if mixed_ok:
            pad = 1 << (num_tokens - 1).bit_length() if 0 < num_tokens <= SMALL_M_TOKENS else None
            fits = [(t, p) for p, t in self.mixed_sizes
                    if p >= num_reqs and t >= num_tokens and (pad is None or t == pad)]
            if fits:
                t, p = min(fits)
                return StepPlan(StepMode.FULL, p, t, self._long_splits(p, t), mixed=True)
        if self.token_sizes and 0 < num_tokens <= self.token_sizes[-1]:
            return StepPlan(StepMode.PIECEWISE, num_reqs,
                            self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)])
        return StepPlan(StepMode.EAGER, num_reqs, num_tokens)

    def forward_mode(self, plan: StepPlan) -> Any:
        if plan.mode is StepMode.PIECEWISE:
            return piecewise_graphs(plan.num_tokens, self.pool)
        return nullcontext()

    def replay_full(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        graph, outputs = self._full[(plan.num_reqs, plan.num_tokens, plan.num_splits, plan.mixed)]
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
            largest: dict[bool, FullKey] = {}  # the largest decode and the largest mixed graph measure the pool
            for k in full_keys:
                largest.setdefault(k[3], k)
            full_keys = [k for k in full_keys if k[:2] == largest[k[3]][:2]]
        # Graphs of an earlier capture (the measuring one) stay alive until this one is done: a pool
        # whose last graph dies is freed, and capturing into its handle afterwards is an error.
        retired = self.retire()
        on_gpu = self.buffers.step_rows.device.type == "cuda"  # (tests drive the same flow on CPU with recorded "graphs")
        if self.pool is None and on_gpu:
            self.pool = torch.cuda.graph_pool_handle()
        free_before = _free_bytes() if on_gpu else 0
        start = time.perf_counter()
        with _progress(len(token_sizes) + len(full_keys), progress and not largest_only) as bar, fast_capture():
            for size in token_sizes:
                inputs, shape = self.model_state.dummy_inputs(self.buffers, size)
                bodies.forward(inputs, shape)  # warm-up: Dynamo variants, Triton autotuning, cuBLAS handles
                with piecewise_graphs(size, self.pool, capture=True):
                    bodies.forward(inputs, shape)
                bar(f"piecewise {size} tokens")
            self.piecewise_capture_seconds = time.perf_counter() - start
            self.full_warmup_seconds = 0.0
            for key in full_keys:
                num_reqs, num_tokens, splits, mixed = key
                self.buffers.fill_padding_rows(num_reqs)
                warm = time.perf_counter()
                bodies.full_step(*key)  # warm-up
                self.full_warmup_seconds += time.perf_counter() - warm
                graph, outputs = cuda_piece._record(bodies.full_step, key, self.pool)
                self._full[key] = (graph, tuple(weak_alias(o) for o in outputs))
                bar(f"full {'mixed' if mixed else 'decode'} {num_reqs} x{splits}" + (f" {num_tokens} tokens" * mixed))
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

    done = 0
    logger.debug("capturing %d graphs", total)

    def step(label: str) -> None:
        nonlocal done
        done += 1
        logger.debug("captured %d/%d: %s", done, total, label)  # (the last line before a hang names the graph)
        if bar is not None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

    try:
        yield step
    finally:
        if bar is not None:
            bar.close()
