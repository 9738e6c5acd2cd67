"""The engine loop: schedule, launch step N+1, then read step N's outputs and update.

The host never waits on the step it just launched: it waits only for the previous step's
sampled ids (which are usually already on the host), so the device always has work queued.
Requests are validated on submission; a bad one raises ValueError and harms no other.
"""

from __future__ import annotations

import random
from typing import Any

from graphrunner.async_output import AsyncStepOutput
from graphrunner.config import EngineConfig
from graphrunner.detokenizer import IncrementalDetokenizer
from graphrunner.kv_cache import BlockPool
from graphrunner.output_processor import OutputProcessor, ParentRequest
from graphrunner.outputs import RequestOutput
from graphrunner.request import Request
from graphrunner.sampling.batch import prepare_request_sampling
from graphrunner.sampling_params import SamplingParams
from graphrunner.scheduler import Scheduler, SchedulerOutput
from graphrunner.tokenizer import load_tokenizer
from graphrunner.worker import build_runner
from model_states import ModelState

_SEED_MASK = (1 << 63) - 1


def derive_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the n completions of one request (index 0 keeps the seed)."""
    if index == 0:
        return seed & _SEED_MASK
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _SEED_MASK


class Engine:
    def __init__(self, config: EngineConfig, model_state: ModelState | None = None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_dir)
        self.runner, num_blocks = build_runner(config, model_state)
        self.scheduler = Scheduler(config.scheduler, BlockPool(num_blocks), config.cache.block_size)
        self._rng = random.Random(config.seed)
        self._parents: dict[str, ParentRequest] = {}
        self._outputs = OutputProcessor(self.tokenizer)
        self._pending: tuple[SchedulerOutput, AsyncStepOutput] | None = None
        self._counter = 0

    # -- submission ----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; raises ValueError (nothing queued) on bad input."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        max_tokens = self._validate(ids, params)
        model = self.config.model
        sampling = prepare_request_sampling(params, model.vocab_size, model.eos_token_ids, self.tokenizer)
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = () if params.ignore_eos else self.config.model.eos_token_ids
        children = [Request(f"{request_id}-{i}" if params.n > 1 else request_id, request_id, i, ids, params,
                            derive_seed(base_seed, i), max_tokens, eos, sampling=sampling)
                    for i in range(params.n)]
        parent = ParentRequest(request_id, text, ids, children, [self._detokenizer(ids, params) for _ in children])
        if params.logprobs is not None:
            parent.logprobs = [[] for _ in children]
            parent.cumulative = [0.0 for _ in children]
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(ids)
        for child in children:
            self.scheduler.add_request(child)
        self._parents[request_id] = parent
        return request_id

    def _prompt_ids(self, prompt: str | list[int] | dict[str, Any]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"the model at {self.config.tokenizer_dir} has no tokenizer; pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> int:
        vocab, max_len = self.config.model.vocab_size, self.config.scheduler.max_model_len
        if not ids:
            raise ValueError("the prompt is empty (it has no tokens)")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={max_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(ids)
        if len(ids) + max_tokens > max_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len={max_len}")
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > max_len:
            raise ValueError(f"truncate_prompt_tokens ({params.truncate_prompt_tokens}) exceeds "
                             f"max_model_len={max_len}")
        unsupported = params.unsupported_features()
        if unsupported:
            raise ValueError(f"sampling settings not supported yet: {', '.join(unsupported)}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        return max_tokens

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                      spaces_between_special_tokens=params.spaces_between_special_tokens,
                                      stop=list(params.stop or []),
                                      include_stop_str_in_output=params.include_stop_str_in_output)

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        for child in parent.children if parent else []:
            self.scheduler.finish(child, "abort")

    # -- the loop ------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then process the previous one's outputs; returns updated requests."""
        sched = self.scheduler.schedule()
        launched = (sched, self.runner.execute(sched)) if sched else None
        if launched is None and self._pending is None and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress: no step to launch and none in flight")
        previous, self._pending = self._pending, launched
        if previous is None:
            return []
        prev_sched, prev_out = previous
        result = prev_out.result()
        changed = self.scheduler.update(prev_sched, result.sampled.tolist(), result.nonfinite.tolist())
        return self._outputs.process(self._parents, changed, result, self.scheduler.finish)
