"""Incremental detokenization with stop-string handling, one instance per request.

Each step decodes only a small window of recent token ids (vLLM-style window/read offsets) and emits the text
the new tokens added to it. Guarantees, for every tokenizer:

* the text never contains an incomplete character (U+FFFD) that later tokens could still complete, and never
  a character that later tokens could still change: with byte-fallback tokenizers (SentencePiece `<0xNN>`
  tokens, whose decoder turns a whole run of byte tokens into U+FFFDs when the run is not valid UTF-8) the
  text of a trailing run of byte tokens is held back until a normal token closes the run, however long (a later
  invalid byte turns the whole run into U+FFFDs, so no earlier part of it is final before then);
* after `finish()`, `output_text == tokenizer.decode(generated_ids, skip_special_tokens=...)` (with the prompt's
  last tokens as left context, so that SentencePiece-style decoders keep the first generated token's leading
  space), truncated at the first stop string;
* stop strings are never partly emitted (`get_delta()` holds back a possible stop-string prefix).

For `transformers` fast tokenizers the windows are decoded by the `tokenizers` Rust backend directly
(`tokenizer._tokenizer.decode`), which is exactly what `tokenizer.decode` does for them minus its Python
wrapper (transformers ignores `spaces_between_special_tokens` for fast tokenizers); other tokenizers go through
`tokenizer.decode`. The window start moves every few tokens, so a step costs about one decode of a few tokens.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Prompt tokens used as left context for the first decode (spacing of SentencePiece-style decoders).
INITIAL_CONTEXT_TOKENS = 5
# A pending (not yet complete) UTF-8 character is at most 3 bytes, hence lies in at most the last 3 tokens.
MAX_PENDING_TOKENS = 3
# Once this many already-emitted tokens lead the decode window, the window start moves up to the last one.
REBASE_AFTER = 4
# The window start steps back over at most this many tokens that decode to nothing (skipped special tokens).
MAX_HIDDEN_BACKOFF = 16
REPLACEMENT_CHAR = "\ufffd"

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class TokenizerInfo:
    """What the detokenizer needs to know about one tokenizer, computed once per tokenizer object."""

    backend: Any  # the `tokenizers.Tokenizer` to decode with, or None: use `tokenizer.decode`
    byte_ids: frozenset[int]  # byte-fallback token ids (`<0x00>`..`<0xFF>`), empty for byte-level BPE
    special_ids: frozenset[int]  # ids that `skip_special_tokens=True` drops


_INFO_CACHE: weakref.WeakKeyDictionary[Any, TokenizerInfo] = weakref.WeakKeyDictionary()


def _rust_backend(tokenizer: Any) -> Any:
    """The fast tokenizer's `tokenizers.Tokenizer` when `tokenizer.decode` is the stock fast decode, else None."""
    from graphrunner.fast_tokenizer import FastTokenizer

    if type(tokenizer) is FastTokenizer:  # decodes with its backend exactly like this (and needs no transformers)
        return tokenizer._tokenizer
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - both are dependencies
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None  # a subclass with its own decoding: only `tokenizer.decode` is authoritative
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _byte_token_names() -> list[str]:
    return [f"<0x{i:02X}>" for i in range(256)]


def _backend_info(backend: Any) -> TokenizerInfo:
    decoder = backend.decoder
    state = decoder.__getstate__() if decoder is not None else b""
    byte_ids: set[int] = set()
    if b"ByteFallback" in state:
        byte_ids = {i for i in map(backend.token_to_id, _byte_token_names()) if i is not None}
    special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    return TokenizerInfo(backend, frozenset(byte_ids), frozenset(special))


def _python_info(tokenizer: Any) -> TokenizerInfo:
    """Byte-fallback and special ids of a tokenizer known only through the `transformers` Python API."""
    try:
        names = _byte_token_names()
        ids = [i for i in tokenizer.convert_tokens_to_ids(names) if isinstance(i, int)]
        byte_ids = {i for i, name in zip(ids, tokenizer.convert_ids_to_tokens(ids)) if name in names}
        special = set(tokenizer.all_special_ids)
    except Exception:  # noqa: BLE001 - any tokenizer-like object works; it just gets no extra knowledge
        byte_ids, special = set(), set()
    return TokenizerInfo(None, frozenset(byte_ids), frozenset(special))


def tokenizer_info(tokenizer: Any) -> TokenizerInfo:
    """Cached per tokenizer object (weakly: the cache never keeps a tokenizer alive)."""
    try:
        return _INFO_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = _rust_backend(tokenizer)
    info = _backend_info(backend) if backend is not None else _python_info(tokenizer)
    try:
        _INFO_CACHE[tokenizer] = info
    except TypeError:  # not weak-referenceable or not hashable: recomputed per request
        pass
    return info


def _make_decode(tokenizer: Any, info: TokenizerInfo, skip: bool, spaces: bool) -> Decode:
    if info.backend is not None:
        backend_decode = info.backend.decode
        return lambda ids: backend_decode(ids, skip)

    def python_decode(ids: list[int]) -> str:
        if not ids:
            return ""
        return tokenizer.decode(
            ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces, clean_up_tokenization_spaces=False
        )

    return python_decode


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, incrementally.

    `output_text` always equals `tokenizer.decode(generated_ids, skip_special_tokens=...)` up to the last
    final character (see the module docstring), truncated at the first stop string. `update()` returns the stop
    string that matched, if any; `get_delta()` / `finish()` serve streaming.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len: int = max((len(s) for s in self.stop), default=0)

        info = tokenizer_info(tokenizer)
        self.uses_rust_decode: bool = info.backend is not None
        self._decode = _make_decode(tokenizer, info, skip_special_tokens, spaces_between_special_tokens)
        self._byte_ids = info.byte_ids
        self._hidden_ids = info.special_ids if skip_special_tokens else frozenset()  # decode to nothing

        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.token_ids: list[int] = []  # generated tokens only
        self._ids: list[int] = context  # decode window source: prompt context + generated tokens
        self._window_start = 0  # start of the decode window in self._ids
        self._read_offset = len(context)  # tokens before this are already reflected in output_text
        self._window_text = self._decode(context)  # decode of self._ids[window_start:read_offset]
        self._context_text = self._window_text  # decode of the prompt context (resynchronisation)
        self._emitted = 0  # characters emitted from the window texts so far (before stop truncation)

        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._sent = 0  # characters of output_text already returned by get_delta()

    # ------------------------------------------------------------------ decoding
    def _stable_end(self, end: int) -> int:
        """Where final text ends: before a trailing run of byte-fallback tokens that later tokens may extend."""
        ids, byte_ids, hidden = self._ids, self._byte_ids, self._hidden_ids
        if ids[end - 1] not in byte_ids and ids[end - 1] not in hidden:
            return end
        floor = self._read_offset
        k, saw_byte = end, False
        while k > floor and (ids[k - 1] in byte_ids or ids[k - 1] in hidden):
            saw_byte = saw_byte or ids[k - 1] in byte_ids
            k -= 1
        return k if saw_byte else end

    def _advance(self, flush: bool = False) -> str:
        """Decodes the pending window; returns newly final text and moves the offsets past it.

        The window is ids[window_start:]; the text of ids[window_start:read_offset] was emitted already.
        Text ending in an incomplete character is held back unless `flush` (end of the request).
        """
        end = len(self._ids)
        if end <= self._read_offset:
            return ""
        stop_at = end if flush or not self._byte_ids else self._stable_end(end)
        if stop_at <= self._read_offset:
            return ""
        text = self._decode(self._ids[self._window_start : stop_at])
        if flush or not text.endswith(REPLACEMENT_CHAR):
            seen = self._window_text
            if stop_at - self._window_start <= REBASE_AFTER and text.startswith(seen):  # the common step, inlined
                self._emitted += len(text) - len(seen)
                self._read_offset = stop_at
                self._window_text = text
                return text[len(seen) :]
            return self._emit(text, stop_at)
        # The trailing U+FFFD may still become a real character; everything before it is final.
        stable = text[:-1]
        floor = max(self._read_offset, stop_at - 1 - MAX_PENDING_TOKENS)
        for k in range(stop_at - 1, floor, -1):
            part = self._decode(self._ids[self._window_start : k])
            if len(part) > len(self._window_text) and stable.startswith(part) and not part.endswith(REPLACEMENT_CHAR):
                return self._emit(part, k)
        return ""

    def _emit(self, window_text: str, new_read_offset: int) -> str:
        if window_text.startswith(self._window_text):
            delta = window_text[len(self._window_text) :]
        else:  # the window's earlier text changed: recompute from the whole sequence (rare, never for real text)
            delta = self._resync(new_read_offset)
        self._emitted += len(delta)
        self._read_offset = new_read_offset
        self._window_text = window_text
        if new_read_offset - self._window_start > REBASE_AFTER:
            self._rebase()
        return delta

    def _resync(self, new_read_offset: int) -> str:
        """New text taken from a decode of the whole sequence up to `new_read_offset`."""
        full = self._decode(self._ids[:new_read_offset])
        start = len(os.path.commonprefix([full, self._context_text]))  # == len(context text) unless it changed
        return full[start + self._emitted :]

    def _rebase(self) -> None:
        """Moves the window start up to the last emitted token that has text of its own.

        It steps back over tokens that decode to nothing (skipped special tokens, at most MAX_HIDDEN_BACKOFF of them)
        and over byte-fallback tokens: a window never starts inside a run of byte tokens, which decodes as a whole.
        """
        ids, r = self._ids, self._read_offset
        w, hidden_seen = r - 1, 0
        while w > self._window_start:
            t = ids[w]
            if t in self._hidden_ids and hidden_seen < MAX_HIDDEN_BACKOFF:
                hidden_seen += 1
            elif t not in self._byte_ids:
                break
            w -= 1
        if w > self._window_start:
            self._window_start = w
            self._window_text = self._decode(ids[w:r])

    # ------------------------------------------------------------------ stop strings
    def _check_stop(self, num_new_chars: int) -> str | None:
        """Looks for stop strings in the new text plus a tail of (longest stop - 1) characters."""
        if not self.stop or num_new_chars == 0:
            return None
        text = self.output_text
        search_start = max(0, len(text) - num_new_chars - self.max_stop_len + 1)
        best_idx, best_stop = -1, None
        for s in self.stop:
            idx = text.find(s, search_start)
            if idx != -1 and (best_idx == -1 or idx < best_idx):
                best_idx, best_stop = idx, s
        if best_stop is None:
            return None
        cut = best_idx + (len(best_stop) if self.include_stop_str_in_output else 0)
        self.output_text = text[:cut]
        return best_stop

    def _append(self, delta: str) -> str | None:
        if not delta:
            return None
        self.output_text += delta
        if not self.stop:
            return None
        matched = self._check_stop(len(delta))
        if matched is not None:
            self.stop_reason = matched
            self.finished = True
        return matched

    # ------------------------------------------------------------------ public API
    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends generated tokens; returns the stop string that matched (or None). No-op once finished."""
        if self.finished or not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        self._ids.extend(new_token_ids)
        delta = self._advance()
        return self._append(delta) if delta else None

    def finish(self) -> str:
        """Ends the request: flushes held-back text (incomplete characters, stop-string tails).

        Returns the remaining streaming delta (what `get_delta()` had not returned yet).
        """
        if not self.finished:
            self._append(self._advance(flush=True))
            self.finished = True
        return self.get_delta()

    def get_delta(self) -> str:
        """Text added since the previous call; holds back a possible stop-string prefix until finished."""
        limit = len(self.output_text)
        if not self.finished and self.max_stop_len > 1:
            limit -= self.max_stop_len - 1
        if limit <= self._sent:
            return ""
        delta = self.output_text[self._sent : limit]
        self._sent = limit
        return delta
