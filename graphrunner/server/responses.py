"""OpenAI response bodies built from RequestOutputs: completion and chat choices, legacy and chat logprobs,
usage, and the incremental state of one streamed choice (text held back while a stop string may complete)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class TokenText:
    """Token id -> text for logprobs (the engine's decoded_token, else the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token])


def legacy_logprobs(tokens: list[int], entries: list[dict[int, Logprob] | None], top: int, text: TokenText,
                    offset: int) -> dict[str, list[Any]]:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(tokens, entries):
        chosen = entry.get(token) if entry else None
        piece = text(token, chosen)
        out["tokens"].append(piece)
        out["token_logprobs"].append(None if chosen is None else max(chosen.logprob, -9999.0))
        if entry is None:
            out["top_logprobs"].append(None)
        else:
            ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, kv[0]))
            tops = {text(t, lp): max(lp.logprob, -9999.0) for t, lp in ranked if lp.rank is not None and lp.rank <= top}
            if chosen is not None:
                tops.setdefault(piece, max(chosen.logprob, -9999.0))
            out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], top: int, text: TokenText) -> dict[str, Any]:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for token, entry in zip(tokens, entries):
        chosen = entry.get(token)
        piece = text(token, chosen)
        ranked = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top)
        content.append({
            "token": piece, "logprob": max(chosen.logprob, -9999.0) if chosen else -9999.0,
            "bytes": list(piece.encode()),
            "top_logprobs": [{"token": text(t, lp), "logprob": max(lp.logprob, -9999.0),
                              "bytes": list(text(t, lp).encode())} for _, t, lp in ranked[:top]],
        })
    return {"content": content}


def completion_choice(out: RequestOutput, comp: CompletionOutput, index: int, echo: bool, top: int | None,
                      text: TokenText) -> dict[str, Any]:
    prefix = (out.prompt or text.tokenizer.decode(out.prompt_token_ids)) if echo else ""
    logprobs = None
    if top is not None and comp.logprobs is not None:
        if echo and out.prompt_logprobs is not None:
            logprobs = legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs, top, text, 0)
            more = legacy_logprobs(comp.token_ids, list(comp.logprobs), top, text, len(prefix))
            for key, values in more.items():
                logprobs[key] += values
        else:
            logprobs = legacy_logprobs(comp.token_ids, list(comp.logprobs), top, text, len(prefix))
    return {"index": index, "text": prefix + comp.text, "logprobs": logprobs, "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason}


def chat_choice(comp: CompletionOutput, index: int, top: int | None, text: TokenText) -> dict[str, Any]:
    logprobs = None
    if top is not None and comp.logprobs is not None:
        logprobs = chat_logprobs(comp.token_ids, list(comp.logprobs), top, text)
    return {"index": index, "message": {"role": "assistant", "content": comp.text}, "logprobs": logprobs,
            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}


class ChoiceStream:
    """What one streamed choice has sent so far; `delta()` gives the new text and token range to send."""

    def __init__(self, hold: int) -> None:
        self.hold = hold  # characters held back while a stop string may still complete
        self.sent_text = 0
        self.sent_tokens = 0
        self.done = False
        self.started = False

    def delta(self, comp: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, first new token, end token) or None when there is nothing to send."""
        finished = comp.finish_reason is not None
        limit = len(comp.text) if finished else max(self.sent_text, len(comp.text) - self.hold)
        text = comp.text[self.sent_text:limit]
        if self.done or (not text and not finished):
            return None
        start, end = self.sent_tokens, len(comp.token_ids)
        if not finished and self.hold:
            end = start if not text else end
        self.sent_text, self.sent_tokens = limit, end
        self.done = finished
        return text, start, end
