"""The engine loop: schedule, launch step N+1, then read step N's outputs and update.

The host never waits on the step it just launched: it waits only for the previous step's
sampled ids (which are usually already on the host), so the device always has work queued.
Requests are validated on submission; a bad one raises ValueError and harms no other. A step
that raises ends the requests it carried with finish_reason "error", leaves nothing in flight,
and the next step works.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from graphrunner.async_output import AsyncStepOutput
from graphrunner.config import EngineConfig
from graphrunner.detokenizer import DeferredDetokenizer, IncrementalDetokenizer
from graphrunner.intake import cache_salt, prompt_token_ids, validate_request
from graphrunner.kv_cache import BlockPool
from graphrunner.log_setup import configure_from_env
from graphrunner.metrics import EngineStats
from graphrunner.output_processor import OutputProcessor, ParentRequest
from graphrunner.outputs import RequestOutput, TokenDeltas
from graphrunner.request import Request
from graphrunner.sampling.batch import prepare_request_sampling
from graphrunner.sampling_params import SamplingParams
from graphrunner.scheduler import Scheduler, SchedulerOutput
from graphrunner.tokenizer import load_tokenizer
from graphrunner.tp_executor import build_engine_runner
from model_states import ModelState

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


def derive_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the n completions of one request (index 0 keeps the seed)."""
    if index == 0:
        return seed & _SEED_MASK
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _SEED_MASK


class StepFailed(RuntimeError):
    """A step raised; the requests it carried ended with finish_reason "error" (listed in `outputs`)."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class Engine:
    def __init__(self, config: EngineConfig, model_state: ModelState | None = None) -> None:
        configure_from_env()  # GRAPHRUNNER_LOG_LEVEL=INFO: the start-up stages with their seconds
        self.config = config
        start = time.perf_counter()
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer_dir)
        logger.info("tokenizer loaded (%.1f s)", time.perf_counter() - start)
        self.runner, num_blocks = build_engine_runner(config, model_state)  # rank 0's, with tensor parallelism
        pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, pool, config.cache.block_size, config.speculative)
        spec_k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        self.stats = EngineStats(config.scheduler.max_model_len, {"model_name": str(config.model_dir)}, spec_k)
        self._rng = random.Random(config.seed)
        self._parents: dict[str, ParentRequest] = {}
        self._outputs = OutputProcessor(self.tokenizer)
        self._pending: tuple[SchedulerOutput, AsyncStepOutput] | None = None
        self._counter = 0
        # seconds step() spent blocked on a step's results (the device still busy): a loop whose steps spend ~0
        # here is host-bound (the engine loop's counters report it per step)
        self.result_wait_s = 0.0
        self._token_deltas: TokenDeltas | None = None  # set by report_token_deltas()

    def report_token_deltas(self) -> None:
        """From now on a step's report that is only a request's new token ids (TokenDeltas: one completion, not
        its first or last report, no logprobs, no engine text) is collected for take_token_deltas() instead of
        being returned by step() as a RequestOutput. For a front (AsyncLLM) that merges ids into its streams."""
        if self._token_deltas is None:
            self._token_deltas = TokenDeltas()

    def take_token_deltas(self) -> TokenDeltas | None:
        """The token deltas collected since the last call (None: not enabled, or none)."""
        deltas = self._token_deltas
        if not deltas:
            return None
        self._token_deltas = TokenDeltas()
        return deltas

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (dropping the engine does it too)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- submission ----------------------------------------------------------------------
    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    final_only: bool = False, delta: bool = False, detokenize: bool = True) -> str:
        """Validate and queue one request; raises ValueError (nothing queued) on bad input. `final_only`: step()
        reports it only when it finishes (no per-step RequestOutput is built: LLM.generate needs none). `delta`:
        each report holds only what is new (ParentRequest.delta_output; the async front merges them).
        `detokenize=False`: no text and no stop-string checks here (the async front detokenizes and, on a stop
        string, calls stop_completion)."""
        params = params if params is not None else SamplingParams()
        if final_only and delta:
            raise ValueError("a request is reported final-only or as deltas, not both")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_token_ids(prompt, self.tokenizer, self.config)
        salt = cache_salt(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        max_tokens = validate_request(ids, params, self.config, self.tokenizer is not None)
        model = self.config.model
        sampling = prepare_request_sampling(params, model.vocab_size, model.eos_token_ids, self.tokenizer)
        if request_id is None:
            request_id = self._new_id()
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = () if params.ignore_eos else model.eos_token_ids
        children = [Request(f"{request_id}-{i}" if params.n > 1 else request_id, request_id, i, ids, params,
                            derive_seed(base_seed, i), max_tokens, eos, sampling=sampling, cache_salt=salt)
                    for i in range(params.n)]
        for child in children:  # checks the cache can ever hold it: raises before anything is queued
            self.scheduler.check_fits(child)
        parent = ParentRequest(request_id, text, ids, children,
                               [self._detokenizer(ids, params, final_only) if detokenize else None
                                for _ in children],
                               final_only=final_only, delta=delta)
        if params.logprobs is not None:
            parent.logprobs = [[] for _ in children]
            parent.cumulative = [0.0 for _ in children]
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(ids)
        for child in children:
            self.scheduler.add_request(child)
        self._parents[request_id] = parent
        self.stats.request_added(request_id, time.monotonic())
        self.stats.prompt_tokens(len(ids))
        return request_id

    def _new_id(self) -> str:
        while str(self._counter) in self._parents:
            self._counter += 1
        self._counter += 1
        return str(self._counter - 1)

    def _detokenizer(self, ids: list[int], params: SamplingParams,
                     final_only: bool) -> IncrementalDetokenizer | DeferredDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        if final_only and not params.stop:  # no text is read before the end: decode once, then
            return DeferredDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                       spaces_between_special_tokens=params.spaces_between_special_tokens)
        return IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                      spaces_between_special_tokens=params.spaces_between_special_tokens,
                                      stop=list(params.stop or []),
                                      include_stop_str_in_output=params.include_stop_str_in_output)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (all n completions) with finish_reason "abort"; returns its final output, or None
        for an id that is not (or no longer) running."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.finish(child, "abort")
        out = self._finished([parent])[0]
        self._note_gauges()
        return out

    def stop_completion(self, request_id: str, index: int, num_tokens: int, stop: str) -> RequestOutput | None:
        """End completion `index` of a request on a stop string found outside the engine (the async front's
        detokenizer), keeping its first num_tokens output tokens; returns the request's final output once every
        completion has ended, else None. A completion that already ended keeps its own reason."""
        parent = self._parents.get(request_id)
        if parent is None or not 0 <= index < len(parent.children):
            return None
        child = parent.children[index]
        if child.finished:
            return None
        del child.output_token_ids[num_tokens:]
        self.scheduler.finish(child, "stop", stop)
        self._note_gauges()
        if all(c.finished for c in parent.children):
            return self._finished([parent])[0]
        return None

    def request_ids(self) -> list[str]:
        """The ids of the requests not yet finished (and reported)."""
        return list(self._parents)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    # -- the loop ------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the previous one's outputs; returns updated requests.

        If anything in it raises, the requests of the steps in flight end with finish_reason "error" and
        StepFailed (carrying their final outputs) is raised from the original error; KeyboardInterrupt and
        other non-Exceptions are re-raised as they are, after the same clean-up, with those final outputs
        attached as `.outputs` (so that a front end can still hand them to whoever waits on them)."""
        launched: tuple[SchedulerOutput, AsyncStepOutput] | None = None
        previous: tuple[SchedulerOutput, AsyncStepOutput] | None = None
        try:
            sched = self.scheduler.schedule()
            launched = (sched, self.runner.execute(sched)) if sched else None
            if launched is None and self._pending is None and self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: no step to launch and none in flight")
            previous, self._pending = self._pending, launched
            self._note_launch(launched)
            outputs = self._process(previous) if previous is not None else []
            self._note_gauges()  # after the finished requests left: the last step reports 0 running, as vLLM's does
            return outputs
        except BaseException as exc:
            outputs = self._fail_in_flight(previous, launched)
            self._note_gauges()
            if not isinstance(exc, Exception):
                exc.outputs = outputs  # type: ignore[attr-defined]
                raise
            failed = sum(any(c.finish_reason == "error" for c in o.outputs) for o in outputs)
            raise StepFailed(f"a step failed ({type(exc).__name__}: {exc}); {failed} request(s) in flight ended with "
                             f"finish_reason='error' ({len(outputs)} final outputs in .outputs); the engine goes on",
                             outputs) from exc

    def _note_launch(self, launched: tuple[SchedulerOutput, AsyncStepOutput] | None) -> None:
        now = time.monotonic()
        if launched is not None:
            sched = launched[0]
            for s in sched.scheduled:
                if s.is_new and s.request.parent_id in self._parents:
                    self.stats.request_scheduled(s.request.parent_id, now)
                    if self.scheduler.pool.enable_caching:
                        self.stats.prefix_cache(s.request.num_host_tokens, s.num_cached)
            if sched.preempted:
                self.stats.preempted(len(sched.preempted))

    def _note_gauges(self) -> None:
        """Running / waiting / KV-usage gauges, set once a step (or an abort) is done, so an idle engine reads 0."""
        pool = self.scheduler.pool
        self.stats.set_running(len(self.scheduler.running))
        self.stats.set_waiting(len(self.scheduler.waiting))
        self.stats.set_kv_cache_usage(1.0 - pool.num_free / pool.num_usable)

    def _process(self, previous: tuple[SchedulerOutput, AsyncStepOutput]) -> list[RequestOutput]:
        prev_sched, prev_out = previous
        t0 = time.perf_counter()
        result = prev_out.result()
        self.result_wait_s += time.perf_counter() - t0
        runs = None
        if result.spec is not None:
            accepted = result.spec.num_accepted.tolist()
            drafts = result.spec.num_drafts.tolist()
            runs = [ids[:a + 1] for ids, a in zip(result.spec.output_ids.tolist(), accepted)]
            self.stats.spec_decode(drafts, accepted)
        changed = self.scheduler.update(prev_sched, result.sampled.tolist(), result.nonfinite.tolist(), runs)
        now = time.monotonic()
        per_parent: dict[str, int] = {}
        for _, req, n in changed:
            if req.finish_reason != "error" and n:
                per_parent[req.parent_id] = per_parent.get(req.parent_id, 0) + n
        for parent_id, count in per_parent.items():
            if parent_id in self._parents:
                self.stats.tokens_generated(parent_id, count, now)
        outputs = self._outputs.process(self._parents, changed, result, self.scheduler.finish, self._token_deltas)
        return self._with_metrics(outputs)

    def _with_metrics(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        now = time.monotonic()
        for out in outputs:
            if out.finished:
                reason = out.outputs[0].finish_reason or "abort"
                generated = sum(len(c.token_ids) for c in out.outputs)
                out.metrics = self.stats.request_finished(out.request_id, reason, now, len(out.prompt_token_ids),
                                                          generated)
            else:
                out.metrics = self.stats.request_metrics(out.request_id)
        return outputs

    def _finished(self, parents: list[ParentRequest]) -> list[RequestOutput]:
        """Final outputs of parents whose children have all been finished; forgets them."""
        outputs = []
        for parent in parents:
            self._parents.pop(parent.request_id, None)
            out = parent.report()
            assert out is not None  # a finished parent always reports
            outputs.append(out)
        return self._with_metrics(outputs)

    def _fail_in_flight(self, *in_flight: tuple[SchedulerOutput, AsyncStepOutput] | None) -> list[RequestOutput]:
        """After a failed step: end every request a step in flight (or half-scheduled) carried with "error".

        `in_flight`: the step whose results were being processed and the one just launched (either may be None);
        the pending step is included too. A request the failed processing had already finished (its last token
        arrived) keeps its reason but is reported and forgotten like the others."""
        steps = [s for s in (self._pending, *in_flight) if s is not None]
        self._pending = None
        self.runner.state.discard_staged()
        victims = {id(r): r for r in self.scheduler.running}  # a half-built schedule only touched running ones
        for sched, _ in steps:
            victims.update((id(s.request), s.request) for s in sched.scheduled)
        hit: dict[str, ParentRequest] = {}
        for req in victims.values():
            self.scheduler.finish(req, "error")
            req.num_inflight = 0
            req.num_spec_inflight = 0
            parent = self._parents.get(req.parent_id)
            if parent is not None:
                hit[parent.request_id] = parent
        for parent in hit.values():  # an n > 1 request ends whole: its other completions are aborted
            for child in parent.children:
                self.scheduler.finish(child, "abort")
        # blocks registered for the failed step may hold no valid KV: forget every cached prefix (no block is
        # held now: only running requests hold blocks, and they all ended above)
        self.scheduler.pool.reset_prefix_cache()
        return self._finished(list(hit.values()))
