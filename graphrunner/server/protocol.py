"""OpenAI request bodies (pydantic models, with vLLM's extra sampling fields) and their mapping onto
SamplingParams. Values are range-checked by SamplingParams itself: a bad one raises ValueError (a 400)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from graphrunner.sampling_params import SamplingParams

# Fields a request may leave unset to get the model's generation_config.json default (as vLLM does).
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (OpenAI's, then vLLM's extra body)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = None
    request_id: str | None = None

    def sampling_kwargs(self, defaults: SamplingParams) -> dict[str, Any]:
        kwargs = {name: getattr(self, name) for name in (
            "n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "stop", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
            "spaces_between_special_tokens", "include_stop_str_in_output", "bad_words", "allowed_token_ids",
            "logit_bias", "truncate_prompt_tokens", "prompt_logprobs")}
        for name in _DEFAULTED:
            if kwargs[name] is None:
                kwargs[name] = getattr(defaults, name)
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        kwargs = self.sampling_kwargs(defaults)
        if self.echo and self.logprobs is not None and kwargs["prompt_logprobs"] is None:
            kwargs["prompt_logprobs"] = self.logprobs
        return SamplingParams.from_optional(max_tokens=self.max_tokens, logprobs=self.logprobs, **kwargs)

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string, a list of strings, one token-id list, or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams.from_optional(max_tokens=max_tokens, logprobs=logprobs,
                                            **self.sampling_kwargs(defaults))


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
