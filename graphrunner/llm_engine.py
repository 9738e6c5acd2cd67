"""vLLM's `LLMEngine` interface over graphrunner's Engine: requests with caller-chosen ids, one `step()`
at a time, outputs reported as each request's SamplingParams.output_kind asks (cumulative or final only).

`LLMEngine.from_engine_args(EngineArgs(...))` builds one; `LLM` holds one as `llm.llm_engine`. DELTA
requests report only what is new (the engine's delta reports, the prompt filled in each time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from graphrunner.engine import Engine, StepFailed
from graphrunner.engine_args import EngineArgs
from graphrunner.generation_config import generation_defaults
from graphrunner.metrics import Metric
from graphrunner.outputs import RequestOutput
from graphrunner.sampling_params import RequestOutputKind, SamplingParams


class LLMEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._final_only: set[str] = set()  # request ids whose intermediate outputs are not reported
        # DELTA requests' ids -> their prompt and ids (the engine sends them in a request's first delta only)
        self._delta: dict[str, tuple[str | None, list[int]] | None] = {}
        self._defaults = generation_defaults(engine.config.generation_config, engine.config.model_dir)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(Engine(engine_args.create_engine_config()))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's generation_config.json defaults (vLLM's generation_config="auto")."""
        return SamplingParams.from_optional(**self._defaults) if self._defaults else SamplingParams()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: Any = None, priority: int = 0,
                    **_unused: Any) -> str:
        """Queue one request under the caller's id (ValueError for a bad request or an id in use)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if priority:
            raise ValueError("priority scheduling is not supported (first come, first served)")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        params = params if params is not None else self.get_default_sampling_params()
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.CUMULATIVE
        final_only = kind is RequestOutputKind.FINAL_ONLY
        rid = self.engine.add_request(prompt, params, request_id, final_only=final_only,
                                      delta=kind is RequestOutputKind.DELTA)
        # marks left by an earlier request of this id that ended elsewhere (LLM.abort, an LLM step) go
        self._final_only.discard(rid)
        self._delta.pop(rid, None)
        if final_only:
            self._final_only.add(rid)
        elif kind is RequestOutputKind.DELTA:
            self._delta[rid] = None
        return rid

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of requests that changed (final ones only for FINAL_ONLY requests).
        A failed step raises StepFailed, whose outputs (all final) end those requests here too."""
        try:
            return self._report(self.engine.step())
        except StepFailed as exc:
            self._report(exc.outputs)  # forget their FINAL_ONLY marks: the ids may be used again
            raise

    def _report(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self._delta:
            self._with_prompts(outputs)
        if not self._final_only:
            return outputs
        reported = [o for o in outputs if o.finished or o.request_id not in self._final_only]
        for o in outputs:
            if o.finished:
                self._final_only.discard(o.request_id)
        return reported

    def _with_prompts(self, outputs: list[RequestOutput]) -> None:
        """vLLM's DELTA outputs carry the prompt every time: fill it in where the engine left it out."""
        for out in outputs:
            if out.request_id not in self._delta:
                continue
            seen = self._delta[out.request_id]
            if seen is None:
                self._delta[out.request_id] = (out.prompt, out.prompt_token_ids)
            else:
                out.prompt, out.prompt_token_ids = seen
            if out.finished:
                del self._delta[out.request_id]

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests by id (unknown or finished ids are skipped, as vLLM does); their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = [out for rid in ids if (out := self.engine.abort_request(rid)) is not None]
        return self._report(outputs)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting)

    def get_metrics(self) -> list[Metric]:
        return self.engine.stats.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests still hold blocks, as vLLM."""
        return self.engine.scheduler.pool.reset_prefix_cache()
