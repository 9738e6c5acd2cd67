"""One request's stream on the async front: the engine loop's token-id deltas merged into the cumulative
RequestOutput its consumer reads, with the text made here (an IncrementalDetokenizer per completion), so the
engine loop spends no time on text. A stop string found here ends that completion: the merged output is cut
after the token that completed it, and the caller tells the engine where (`pending_stops`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphrunner.detokenizer import IncrementalDetokenizer
from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput
from graphrunner.sampling_params import SamplingParams


@dataclass
class _Completion:
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cut: bool = False  # ended here on a stop string: later engine tokens are dropped

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class MergedStream:
    """Deltas in (`add`), the newest cumulative output out (`output`), built only when the consumer reads."""

    def __init__(self, params: SamplingParams, tokenizer: Any) -> None:
        self.params = params
        self.tokenizer = tokenizer if params.detokenize else None
        self.head: RequestOutput | None = None
        self.completions: dict[int, _Completion] = {}
        self.pending_stops: list[tuple[int, int, str]] = []  # (completion index, tokens kept, stop string)

    @property
    def finished(self) -> bool:
        """Every completion ended (by the engine, or here on a stop string)."""
        return (self.head is not None and len(self.completions) == self.params.n
                and all(c.finished for c in self.completions.values()))

    def add(self, delta: RequestOutput) -> None:
        if self.head is None:
            self.head = delta  # the first delta carries the prompt, its ids and prompt logprobs
        else:
            self.head.metrics, self.head.num_cached_tokens = delta.metrics, delta.num_cached_tokens
        for comp in delta.outputs:
            acc = self.completions.get(comp.index)
            if acc is None:
                acc = self.completions[comp.index] = _Completion(self._detokenizer())
            if acc.finished:
                continue  # ended here on a stop string: what the engine made after it is dropped
            self._append(comp.index, acc, comp)
            if not acc.finished and comp.finish_reason is not None:
                acc.finish_reason, acc.stop_reason = comp.finish_reason, comp.stop_reason
                if acc.detok is not None:
                    acc.detok.finish()  # the final text: what was held back is flushed

    def add_ids(self, token_ids: list[int]) -> None:
        """New token ids of the only completion (a TokenDeltas report: never a request's first or last)."""
        acc = self.completions[0]
        if not acc.finished:  # ended here on a stop string: what the engine made after it is dropped
            self._append(0, acc, CompletionOutput(0, "", token_ids))

    def _detokenizer(self) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        p = self.params
        assert self.head is not None
        return IncrementalDetokenizer(self.tokenizer, self.head.prompt_token_ids,
                                      skip_special_tokens=p.skip_special_tokens,
                                      spaces_between_special_tokens=p.spaces_between_special_tokens,
                                      stop=list(p.stop or []), include_stop_str_in_output=p.include_stop_str_in_output)

    def _append(self, index: int, acc: _Completion, comp: CompletionOutput) -> None:
        if comp.logprobs is not None and acc.logprobs is None:
            acc.logprobs = []
        acc.cumulative_logprob = comp.cumulative_logprob
        if acc.detok is None or not acc.detok.stop:
            acc.token_ids.extend(comp.token_ids)
            if comp.logprobs is not None:
                acc.logprobs.extend(comp.logprobs)  # type: ignore[union-attr]
            if acc.detok is not None:
                acc.detok.update(comp.token_ids)
            return
        for i, token in enumerate(comp.token_ids):  # stop strings: token by token, to know where one completes
            acc.token_ids.append(token)
            if comp.logprobs is not None:
                acc.logprobs.append(comp.logprobs[i])  # type: ignore[union-attr]
            stop = acc.detok.update([token])
            if stop is not None:
                acc.finish_reason, acc.stop_reason, acc.cut = "stop", stop, True
                if acc.logprobs is not None:  # the engine's sum covered tokens dropped here
                    acc.cumulative_logprob = sum(e[t].logprob for t, e in zip(acc.token_ids, acc.logprobs))
                self.pending_stops.append((index, len(acc.token_ids), stop))
                return

    def output(self) -> RequestOutput:
        head = self.head
        assert head is not None
        outs = []
        for i, c in sorted(self.completions.items()):
            text = ""
            if c.detok is not None:
                text = c.detok.output_text
                if not c.finished and c.detok.max_stop_len > 1:  # may still become a stop string: held back
                    text = text[:max(0, len(text) - (c.detok.max_stop_len - 1))]
            outs.append(CompletionOutput(i, text, list(c.token_ids), c.cumulative_logprob,
                                         list(c.logprobs) if c.logprobs is not None else None,
                                         c.finish_reason, c.stop_reason))
        return RequestOutput(head.request_id, head.prompt, head.prompt_token_ids, outs, self.finished,
                             head.prompt_logprobs, head.metrics, head.num_cached_tokens)


class DeltaCursor:
    """vLLM's RequestOutputKind.DELTA over a request's cumulative outputs: each output holds only what is new
    since the previous one (tokens, text, logprobs; prompt logprobs in the first only), the prompt in every one.
    The cumulative text must only grow (MergedStream holds back a possible stop string, so it does)."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int]] = {}  # completion index -> (tokens, text characters) given out
        self._first = True

    def __call__(self, out: RequestOutput) -> RequestOutput:
        comps = []
        for c in out.outputs:
            n, k = self._sent.get(c.index, (0, 0))
            comps.append(CompletionOutput(c.index, c.text[k:], c.token_ids[n:], c.cumulative_logprob,
                                          c.logprobs[n:] if c.logprobs is not None else None, c.finish_reason,
                                          c.stop_reason))
            self._sent[c.index] = (len(c.token_ids), len(c.text))
        first, self._first = self._first, False
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, comps, out.finished,
                             out.prompt_logprobs if first else None, out.metrics, out.num_cached_tokens)
