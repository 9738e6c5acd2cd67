"""Chat prompts: OpenAI-style conversations rendered with the tokenizer's chat template (as vLLM's
`LLM.chat` does), validated message by message with clear errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_ROLES = ("system", "user", "assistant", "tool", "developer")


def _content(message: Mapping[str, Any], where: str) -> Any:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported, "
                                 f"got {part!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _conversation(messages: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"conversation {index} must be a non-empty list of message dicts")
    out = []
    for i, message in enumerate(messages):
        where = f"conversation {index}, message {i}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        if message.get("role") not in _ROLES:
            raise ValueError(f"{where}: role must be one of {_ROLES}, got {message.get('role')!r}")
        out.append({**message, "content": _content(message, where)})
    return out


def render_chat(tokenizer: Any, messages: Any, *, chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: Any = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One TokensPrompt per conversation (`messages` is one conversation or a list of them)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template, and this model has none")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=... (a Jinja template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    batch = isinstance(messages, Sequence) and bool(messages) and not isinstance(messages[0], Mapping)
    conversations = list(messages) if batch else [messages]
    prompts = []
    for index, conv in enumerate(conversations):
        text = tokenizer.apply_chat_template(
            _conversation(conv, index), tokenize=False, chat_template=chat_template, tools=tools,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}))
        # the template wrote any special tokens itself: the tokenizer must not add BOS again
        prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return prompts
