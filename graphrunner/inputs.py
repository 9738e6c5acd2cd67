"""vLLM's prompt dictionaries: `TextPrompt` ({"prompt": str}) and `TokensPrompt` ({"prompt_token_ids": [...]});
any LLM / LLMEngine method that takes a prompt takes these, a plain str or a list of token ids."""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
