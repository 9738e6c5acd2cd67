"""The offline Python API, with vLLM's names: `LLM(model=...).generate(prompts, sampling_params)`.

Prompts are strings, token-id lists, vLLM's TextPrompt / TokensPrompt dicts, or lists of those;
results come back in prompt order. `stream()` yields partial outputs as they grow, `chat()` applies
the tokenizer's chat template. Methods may be called from several threads: engine access is
serialised and every caller receives only its own requests' outputs.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from graphrunner.engine import Engine, StepFailed
from graphrunner.engine_args import EngineArgs
from graphrunner.llm_engine import LLMEngine
from graphrunner.metrics import Metric
from graphrunner.outputs import RequestOutput
from graphrunner.profiler import Profiler, ProfilerConfig
from graphrunner.progress import GenerateProgress
from graphrunner.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict[str, Any]


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts is None or not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    is_id = [isinstance(p, int) and not isinstance(p, bool) for p in prompts]
    if prompts and all(is_id):
        return [prompts]  # one prompt given as token ids
    if any(is_id):  # a bare int is no prompt: this was meant as token ids
        raise ValueError(f"token ids must all be integers, got {sorted({type(p).__name__ for p in prompts})} in "
                         f"one list")
    return prompts


def _seed_everything(seed: int) -> None:
    """Seed the process's Python, NumPy and torch RNGs, as vLLM does, so a script's own random numbers repeat."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _engine_args(model: Any, kwargs: dict[str, Any]) -> EngineArgs:
    known = set(EngineArgs.__dataclass_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; see graphrunner.EngineArgs for the supported ones")
    return EngineArgs(model=model, **kwargs)


class LLM:
    """An engine over one local HF-format model directory (the shipped demo model by default).

    Takes vLLM's engine arguments (`graphrunner.EngineArgs`' fields): max_model_len, max_num_seqs,
    gpu_memory_utilization, enforce_eager, compilation_config, generation_config, ... ."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = _engine_args(model, kwargs)
        self.config = self.engine_args.create_engine_config()
        profiler = ProfilerConfig.coerce(self.engine_args.profiler_config)  # refused before the model loads
        _seed_everything(self.config.seed)
        self.engine = Engine(self.config)
        self.llm_engine = LLMEngine(self.engine)
        self._lock = threading.RLock()
        self._mailboxes: dict[str, deque[RequestOutput]] = {}  # per submitted request, until its final output
        self._stepping = False  # inside engine.step() (with the lock held)
        self._deferred_aborts: list[str] = []  # aborts asked for from inside a step, done right after it
        self._profiler = Profiler(profiler.torch_profiler_dir or None)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline metrics: counters, gauges and histograms under vLLM's names."""
        with self._lock:
            return self.engine.stats.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests still hold blocks."""
        with self._lock:
            return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """Start a torch profiler trace (into $VLLM_TORCH_PROFILER_DIR or $GRAPHRUNNER_TORCH_PROFILER_DIR)."""
        self._profiler.start()

    def stop_profile(self) -> None:
        self._profiler.stop()

    # -- submission and collection ---------------------------------------------------------
    def _submit(self, prompts: Any, sampling_params: Any, lora_request: Any = None,
                final_only: bool = True) -> list[str]:
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(plist)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} sampling params for {len(plist)} prompts")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        ids: list[str] = []
        with self._lock:
            try:
                for prompt, p in zip(plist, params):
                    ids.append(self.engine.add_request(prompt, p, final_only=final_only))
                    self._mailboxes[ids[-1]] = deque()
            except BaseException:
                self._abort_all(ids)  # all-or-nothing: a bad prompt in the batch leaves no request behind
                raise
        return ids

    def _abort_all(self, ids: Sequence[str]) -> None:
        with self._lock:
            if self._stepping:  # re-entered from inside a step (a stream finalised by the cyclic GC on this
                self._deferred_aborts.extend(ids)  # thread): the scheduler's lists are mid-change, abort after it
                return
            for rid in ids:
                self.engine.abort_request(rid)
                self._mailboxes.pop(rid, None)

    def _collect(self, ids: set[str]) -> list[RequestOutput]:
        """Outputs of `ids` available now, stepping the engine once if none are; raises StepFailed only when one
        of `ids` failed (other callers' failed requests reach them as finish_reason="error" outputs)."""
        with self._lock:
            ready = self._drain(ids)
            if ready:
                return ready
            if not self.engine.has_unfinished():
                missing = sorted(rid for rid in ids if rid in self._mailboxes)
                raise RuntimeError(f"requests {missing} are not running and never finished")
            try:
                self._route(self._step())
            except StepFailed as exc:
                self._route(exc.outputs)
                if any(o.request_id in ids for o in exc.outputs):
                    self._drain(ids)
                    raise
            except BaseException as exc:  # KeyboardInterrupt: the requests it ended still reach their callers
                outputs = getattr(exc, "outputs", None)
                self._route(outputs if isinstance(outputs, list) else [])
                raise
            return self._drain(ids)

    def _step(self) -> list[RequestOutput]:
        """engine.step(); aborts re-entered meanwhile (see `_abort_all`) are done once it has returned."""
        self._stepping = True
        try:
            return self.engine.step()
        finally:
            self._stepping = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            self._abort_all(deferred)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            box = self._mailboxes.get(out.request_id)
            if box is not None:
                box.append(out)

    def _drain(self, ids: set[str]) -> list[RequestOutput]:
        ready: list[RequestOutput] = []
        for rid in list(ids):
            box = self._mailboxes.get(rid)
            while box:
                out = box.popleft()
                ready.append(out)
                if out.finished:
                    del self._mailboxes[rid]
                    ids.discard(rid)
                    break
        return ready

    # -- the public loops ----------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: Any = True, lora_request: Any = None,
                 **_ignored: Any) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order."""
        ids = self._submit(prompts, sampling_params, lora_request)
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        progress = GenerateProgress(len(ids), use_tqdm)
        try:
            while pending:
                for out in self._collect(pending):
                    if out.finished:
                        final[out.request_id] = out
                        progress.finished(out)
        except BaseException:
            self._abort_all([rid for rid in ids if rid not in final])
            raise
        finally:
            progress.close()
        return [final[rid] for rid in ids]

    def stream(self, prompts: Any, sampling_params: Any = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (cumulative) each time one of these requests gains tokens. Closing or
        abandoning the iterator aborts the requests it still runs."""
        plist = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params]
        if any(isinstance(p, SamplingParams) and p.output_kind is RequestOutputKind.DELTA for p in plist):
            raise ValueError("stream() yields cumulative outputs: output_kind=DELTA is not supported")
        ids = self._submit(prompts, sampling_params, final_only=False)
        pending = set(ids)
        try:
            while pending:
                yield from self._collect(pending)
        finally:
            self._abort_all([rid for rid in ids if rid in self._mailboxes])

    def chat(self, messages: Any, sampling_params: Any = None, use_tqdm: Any = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: Any = None,
             chat_template_kwargs: dict[str, Any] | None = None, **_ignored: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them."""
        from graphrunner.chat import render_chat

        prompts = render_chat(self.engine.tokenizer, messages, chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, tools=tools,
                              chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def abort(self, request_id: str) -> RequestOutput:
        """Abort a running request (all its n completions); its final output (finish_reason "abort") also reaches
        whoever waits on it. ValueError for an unknown or finished id."""
        with self._lock:
            out = self.engine.abort_request(request_id)
            if out is None:
                raise ValueError(f"no running request with id {request_id!r}")
            self._route([out])
            return out
