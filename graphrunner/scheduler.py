"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute, and prefix-cache
admission (a request starts past the longest cached run of whole blocks of its known tokens).

It decides from counts alone (never from token values), so step N+1 can be scheduled while
step N still runs on the device. Token values arrive in `update()` one step late; a token
sampled for a request that finished in the meantime is dropped there. With speculative decoding a
decoding request gets 1 + k tokens (its last token and k draft slots); how many drafts the device
accepted arrives with the tokens, so until then `num_computed_tokens` is an upper bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from graphrunner.config import SchedulerConfig
from graphrunner.kv_cache import BlockPool, blocks_needed
from graphrunner.prefix_cache import RecentKeys, extend_block_hashes
from graphrunner.request import Request, RequestStatus
from graphrunner.spec_config import SpeculativeConfig


@dataclass
class ScheduledRequest:
    request: Request
    row: int                 # state-table row (fixed for the step even if the request later moves)
    num_tokens: int          # tokens scheduled this step
    is_new: bool             # row must be (re)initialised: first admission or resumption after preemption
    new_block_ids: list[int]  # blocks appended to the request this step
    first_new_block: int     # index in the request's block list where new_block_ids start
    seq_len: int             # context length after this step (cached + scheduled tokens)
    samples: bool            # this step reaches the end of known tokens, so its sampled token is real
    num_cached: int = 0      # is_new: tokens served from the prefix cache at this admission
    num_spec: int = 0        # draft slots verified this step (num_tokens = 1 + num_spec for such a decode)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # speculation was on for this step (not disabled by batch size): only then do the model proposers run (observe
    # the step, draft for the next); a step with it off costs what a step without speculation does
    spec_active: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class RowFreeList:
    """Rows of the persistent state table; a request keeps its row for as long as it runs."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))

    def take(self) -> int:
        return self._free.pop()

    def give_back(self, row: int) -> None:
        self._free.append(row)

    @property
    def num_free(self) -> int:
        return len(self._free)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int,
                 spec: SpeculativeConfig | None = None) -> None:
        self.config = config
        self.spec = spec
        # a draft model (an EAGLE head) writes its KV up to k positions past a row's last token after each step:
        # blocks are kept ahead
        model_proposer = spec is not None and spec.method in ("draft_model", "eagle")
        self.lookahead = spec.num_speculative_tokens if spec is not None and model_proposer else 0
        # a model proposer needs its own KV at every position it drafts from; a step with speculation off does not
        # run it, so the requests in that step lose speculation (Request.proposer_gap)
        self.tracks_proposer_kv = model_proposer
        self._observed = True  # this step runs the model proposer (set by schedule())
        self.pool = pool
        self.block_size = block_size
        self.recent_keys = RecentKeys(block_size)  # keys of recent prompts, reused where a new one shares blocks
        self.rows = RowFreeList(config.max_num_seqs)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # lifetime count, for tests and metrics

    # -- admission -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """ValueError unless the whole cache could hold the request at its longest."""
        need = self._blocks_for(req.prompt_len + req.max_tokens)
        if need > self.pool.num_usable:
            raise ValueError(
                f"request {req.request_id} needs {need} KV blocks (prompt {req.prompt_len} + max_tokens "
                f"{req.max_tokens}) but the cache only has {self.pool.num_usable}; lower max_tokens or raise "
                f"num_gpu_blocks_override / gpu_memory_utilization"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        spec_k = self._spec_tokens()
        out.spec_active = self._observed = spec_k > 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new, num_spec = self._num_new_tokens(req, budget, spec_k)
            if num_new == 0:
                i += 1
                continue
            new_blocks = self._grow(req, num_new, out)
            if new_blocks is None:  # req itself was preempted to make room
                continue
            out.scheduled.append(self._commit(req, num_new, new_blocks, is_new=False, num_spec=num_spec))
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _spec_tokens(self) -> int:
        """Draft slots per decoding request this step: k, or 0 when speculation is off or the batch is too big."""
        spec = self.spec
        if spec is None:
            return 0
        if spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size:
            return 0
        return spec.num_speculative_tokens

    def _num_new_tokens(self, req: Request, budget: int, spec_k: int = 0) -> tuple[int, int]:
        """(tokens to schedule, of which draft slots). The draft slots are capped only by the budget and by
        max_model_len (the verified positions, counting every in-flight draft as accepted, stay inside it), not by
        max_tokens: a run that crosses max_tokens is cut there by update(), and a request keeps its k slots to the
        end, so its verify steps stay uniform (FULL graphs; a capped one ran piecewise with the model proposers'
        draft steps launched one by one, ~10 ms each for the 8-layer demo draft on the H200, seventeenth session)."""
        if req.num_generated_upper >= req.max_tokens:
            return 0, 0  # its last token may be in flight; update() will finish it
        num_new = req.num_known_tokens - (req.num_computed_tokens - req.num_spec_inflight)
        if num_new == 1 and spec_k and req.proposer_gap is None and spec_allowed(req):
            room = self.config.max_model_len - req.prompt_len - req.num_generated_upper  # last position + room < len
            num_spec = max(0, min(spec_k, room, budget - 1))
            return 1 + num_spec, num_spec
        return min(num_new, budget), 0

    def _grow(self, req: Request, num_new: int, out: SchedulerOutput) -> list[int] | None:
        """Allocate blocks for num_new more tokens, preempting the newest running requests if needed."""
        need = self._blocks_for(req.num_computed_tokens + num_new) - len(req.block_ids)
        while True:
            got = self.pool.allocate(max(need, 0))
            if got is not None:
                return got
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return None

    def _blocks_for(self, num_tokens: int) -> int:
        """Blocks a request needs once num_tokens positions are computed (plus the draft model's lookahead)."""
        return blocks_needed(min(num_tokens + self.lookahead, self.config.max_model_len) if self.lookahead
                             else num_tokens, self.block_size)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_inflight:  # preempted with a token still in flight: wait for its value
                break
            hits = self._cache_hits(req)
            cached = len(hits) * self.block_size
            remaining = req.num_known_tokens - cached
            if remaining > budget and not self.config.enable_chunked_prefill:
                break  # the whole prompt must fit one step: it waits for an emptier step
            num_new = min(remaining, budget)
            self.pool.hold(hits)  # before allocating: the hits must not be evicted for this very request
            got = self.pool.allocate(self._blocks_for(cached + num_new) - len(hits))
            if got is None:
                self.pool.free(hits)
                break
            self.waiting.popleft()
            req.row = self.rows.take()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = cached  # the row starts past the hits: prep kernels just begin later
            req.num_registered_blocks = len(hits)  # already cached under their keys: nothing to register again
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            self.running.append(req)
            scheduled = self._commit(req, num_new, hits + got, is_new=True)
            scheduled.num_cached = cached
            out.scheduled.append(scheduled)
            budget -= num_new

    # -- the prefix cache --------------------------------------------------------------------
    def _cache_hits(self, req: Request) -> list[int]:
        """Cached blocks of req's longest known prefix, whole blocks only and at least one token left to compute;
        none for a request that wants prompt logprobs (those need the whole prompt's logits)."""
        if not self.pool.enable_caching or req.params.prompt_logprobs is not None:
            return []
        known = req.num_host_tokens
        self._extend_hashes(req, known)
        # a request admitted while the proposer runs reads its KV at the hits: blocks computed without it stop there
        complete_only = self.tracks_proposer_kv and self._observed
        hits = self.pool.lookup(req.block_hashes[:(known - 1) // self.block_size], complete_only)
        if self.spec is not None and self.spec.method == "eagle":
            # an EAGLE head's KV at a block's last position was computed from the token after the block, which the
            # block's key does not cover: the last hit is recomputed (as vLLM does), its head KV then this request's
            return hits[:-1]
        return hits

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Keys of req's full blocks within its first num_tokens tokens; hashes only the blocks still missing."""
        start = len(req.block_hashes) * self.block_size
        if start == 0 and num_tokens >= self.block_size:  # a first admission: a remembered prompt may share blocks
            req.block_hashes = self.recent_keys.keys(req.token_array(0, num_tokens), num_tokens, req.cache_salt)
        elif num_tokens - start >= self.block_size:
            extend_block_hashes(req.block_hashes, req.token_array(start, num_tokens), num_tokens, self.block_size,
                                req.cache_salt, start)

    def _register_blocks(self, req: Request) -> None:
        """Register req's newly full blocks whose tokens are computed (or launched) and known to the host."""
        if not self.pool.enable_caching or req.row < 0:
            return
        full = min(req.num_computed_tokens, req.num_host_tokens) // self.block_size
        if full <= req.num_registered_blocks:
            return
        self._extend_hashes(req, full * self.block_size)
        gap = req.proposer_gap
        for i in range(req.num_registered_blocks, full):
            partial = gap is not None and (i + 1) * self.block_size > gap  # some position's proposer KV missing
            self.pool.register(req.block_ids[i], req.block_hashes[i], partial)
        req.num_registered_blocks = full

    def _commit(self, req: Request, num_new: int, new_blocks: list[int], is_new: bool,
                num_spec: int = 0) -> ScheduledRequest:
        first = len(req.block_ids)
        req.block_ids.extend(new_blocks)
        if self.tracks_proposer_kv and not self._observed and req.proposer_gap is None:
            # from here on the proposer's KV is missing (a new row: its hits may be partial blocks too)
            req.proposer_gap = 0 if is_new else req.num_computed_tokens - req.num_spec_inflight
        samples = req.num_computed_tokens - req.num_spec_inflight + num_new - num_spec == req.num_known_tokens
        req.num_computed_tokens += num_new
        if samples:
            req.num_inflight += 1
            req.num_spec_inflight += num_spec
        self._register_blocks(req)
        return ScheduledRequest(req, req.row, num_new, is_new, new_blocks, first, req.num_computed_tokens, samples,
                                num_spec=num_spec)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.proposer_gap = None  # recomputed from its hits (complete ones, if the proposer runs then) onwards
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_registered_blocks = 0
        if req.row >= 0:
            self.rows.give_back(req.row)
            req.row = -1

    # -- results -------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[int], nonfinite: list[bool] | None = None,
               spec_tokens: list[list[int]] | None = None) -> list[tuple[int, Request, int]]:
        """Apply step `out`'s sampled tokens (one per scheduled request; with speculation, `spec_tokens[b]` is
        the whole run request b emitted: its accepted drafts, then the corrected or bonus token).

        Returns (batch row, request, new output tokens) for each live request that got tokens or ended in
        error; a request whose logits held NaN/inf is finished with reason "error" and its tokens dropped. A
        stop inside a run ends the request there: the run's later tokens are dropped.
        """
        changed: list[tuple[int, Request, int]] = []
        for b, (sched, token) in enumerate(zip(out.scheduled, sampled)):
            if not sched.samples:
                continue
            req = sched.request
            run = spec_tokens[b] if spec_tokens is not None else [token]
            req.num_inflight -= 1
            req.num_spec_inflight -= sched.num_spec
            if req.status is RequestStatus.RUNNING:  # a preempted request restarted its count from 0
                req.num_computed_tokens -= sched.num_spec - (len(run) - 1)  # the rejected drafts
            if req.finished:
                continue  # finished while this step was in flight: the tokens are dropped
            if nonfinite is not None and nonfinite[b]:
                self.finish(req, "error")
                changed.append((b, req, 0))
                continue
            n = 0
            for tok in run:
                req.output_token_ids.append(tok)
                n += 1
                self._register_blocks(req)  # first: a request ending here leaves its full blocks cached
                self._check_stop(req, tok)
                if req.finished:
                    break
            changed.append((b, req, n))
        return changed

    def _check_stop(self, req: Request, token: int) -> None:
        """Finish req if `token`, just appended, ends it."""
        params = req.params
        if len(req.output_token_ids) >= params.min_tokens:
            if token in params.stop_token_ids:
                self.finish(req, "stop", token)
                return
            if not params.ignore_eos and token in req.eos_token_ids:
                self.finish(req, "stop", None)
                return
        if len(req.output_token_ids) >= req.max_tokens:
            self.finish(req, "length", None)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (also used for stop strings and aborts); its blocks and row are freed at once.

        Freeing while a step that still uses them is in flight is safe: later steps are ordered
        after it on the same stream, so a new owner's writes land after the old owner's.
        """
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason


def spec_allowed(req: Request) -> bool:
    """Whether a request may be given draft slots: only sampling whose stages are the same at every position
    (temperature, top-k/top-p/min-p, logprobs). Penalties, bad words and min_tokens depend on the tokens before
    each draft position, and logit_bias / allowed_token_ids are kept off the verify path; such requests decode
    one token per step (exactly, since they never have drafts in flight)."""
    p, data = req.params, req.sampling
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return False
    if data.logit_bias or data.allowed is not None or data.banned or data.bad_prefixes:
        return False
    return len(req.output_token_ids) >= p.min_tokens
