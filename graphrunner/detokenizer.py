"""Incremental detokenization with stop-string handling, one instance per request.

Decodes only a small window of recent token ids per step (vLLM-style prefix/read offsets), never emits
an incomplete UTF-8 character (U+FFFD) that later tokens could complete, and truncates at stop strings.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens used as left context for the first decode (spacing of SentencePiece-style decoders).
INITIAL_CONTEXT_TOKENS = 5
# A pending (not yet complete) UTF-8 character is at most 3 bytes, hence lies in at most the last 3 tokens.
MAX_PENDING_TOKENS = 3
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, incrementally.

    `output_text` always equals `tokenizer.decode(generated_ids, skip_special_tokens=...)` up to the last
    complete character (byte-level BPE), truncated at the first stop string. `update()` returns the stop
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

        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.token_ids: list[int] = []  # generated tokens only
        self._ids: list[int] = context  # decode window source: prompt context + generated tokens
        self._prefix_offset = 0  # start of the decode window in self._ids
        self._read_offset = len(context)  # tokens before this are already reflected in output_text
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False
        self._sent = 0  # characters of output_text already returned by get_delta()

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _advance(self, flush: bool = False) -> str:
        """Decodes the pending window; returns newly stable text and moves the offsets past it.

        The window is ids[prefix_offset:]; the text of ids[prefix_offset:read_offset] was emitted already.
        Text ending in an incomplete character is held back unless `flush` (end of the request).
        """
        ids = self._ids
        end = len(ids)
        if end <= self._read_offset:
            return ""
        full = self._decode(ids[self._prefix_offset :])
        if flush or not full.endswith(REPLACEMENT_CHAR):
            return self._emit(full, end)
        # The trailing U+FFFD may still become a real character; everything before it is final.
        stable = full[:-1]
        for k in range(end - 1, max(self._read_offset, end - 1 - MAX_PENDING_TOKENS), -1):
            text = self._decode(ids[self._prefix_offset : k])
            if len(text) > len(self._prefix_text) and stable.startswith(text):
                return self._emit(text, k)
        return ""

    def _emit(self, window_text: str, new_read_offset: int) -> str:
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = new_read_offset
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return delta

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
        return self._append(self._advance())

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
