"""Turning one step's host results into user-visible state: detokenized text, stop strings,
logprobs and prompt logprobs, and the RequestOutput of each touched request.

Runs on the host after the step's outputs arrived; it never touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphrunner.async_output import StepOutput
from graphrunner.detokenizer import DeferredDetokenizer, IncrementalDetokenizer
from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput, TokenDeltas
from graphrunner.request import Request
from graphrunner.sampling.logprobs import LogprobsTensors


@dataclass
class ParentRequest:
    """A user request: its prompt and its n child sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer | DeferredDetokenizer | None]
    logprobs: list[list[dict[int, Logprob]] | None] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    final_only: bool = False  # report only the final output (building one per step is O(length) each time)
    delta: bool = False  # report only what is new (see delta_output)
    _sent: list[tuple[int, int]] = field(default_factory=list)  # per child: (tokens, text characters) reported

    def finish_text(self) -> None:
        """A finished completion's text is final: flush what its detokenizer held back (an incomplete character
        at the very end, a possible stop-string prefix), so it equals tokenizer.decode of its tokens."""
        for child, detok in zip(self.children, self.detoks):
            if detok is not None and child.finished and not detok.finished:
                detok.finish()

    def report(self) -> RequestOutput | None:
        return self.delta_output() if self.delta else self.output()

    def delta_output(self) -> RequestOutput | None:
        """What is new since the previous report (None: nothing, e.g. after a prefill chunk): new tokens, text and
        logprobs per completion; the prompt, its ids and prompt logprobs ride in the first report only (the
        engine-core process pickles every report; prompt logprobs are complete once a token was sampled). Text
        that may still become part of a stop string is held back until its completion finishes, so text once
        reported is never taken back."""
        if self._ids_only:
            return self._delta_ids_only()
        self.finish_text()
        first = not self._sent
        sent = self._sent or [(0, 0)] * len(self.children)
        if (not all(c.finished for c in self.children)
                and all(len(c.output_token_ids) == n for c, (n, _) in zip(self.children, sent))):
            return None
        outs = []
        for i, (child, detok) in enumerate(zip(self.children, self.detoks)):
            sent_tokens, sent_chars = sent[i]
            text = detok.output_text if detok is not None else ""
            limit = len(text)
            if detok is not None and not child.finished and detok.max_stop_len > 1:
                limit = max(sent_chars, limit - (detok.max_stop_len - 1))
            ids = child.output_token_ids
            lps = self.logprobs[i] if self.logprobs else None
            outs.append(CompletionOutput(
                child.index, text[sent_chars:limit], ids[sent_tokens:],
                cumulative_logprob=self.cumulative[i] if lps is not None else None,
                logprobs=lps[sent_tokens:] if lps is not None else None,
                finish_reason=child.finish_reason, stop_reason=child.stop_reason))
            sent[i] = (len(ids), limit)
        self._sent = sent
        done = all(c.finished for c in self.children)
        cached = max(0, self.children[0].num_cached_tokens)
        return RequestOutput(self.request_id, self.prompt if first else None, self.prompt_token_ids if first else [],
                             outs, done, self.prompt_logprobs if first else None, num_cached_tokens=cached)

    @property
    def _ids_only(self) -> bool:
        """One completion whose reports are token ids alone: no text made here (the front detokenizes), no
        logprobs."""
        return len(self.children) == 1 and self.detoks[0] is None and not self.logprobs

    def _take_ids(self) -> list[int]:
        """The only completion's ids since the previous report, now marked reported."""
        ids = self.children[0].output_token_ids
        sent = self._sent[0][0] if self._sent else 0
        self._sent = [(len(ids), 0)]
        return ids[sent:]

    def token_delta(self) -> list[int] | None:
        """The new token ids when this step's report can be only those (TokenDeltas), else None: delta reports of
        ids alone, a first report already sent, the completion not finished."""
        if not (self.delta and self._sent and self._ids_only) or self.children[0].finished:
            return None
        return self._take_ids()

    def _delta_ids_only(self) -> RequestOutput | None:
        """delta_output for the server's common case, once per request per step (see _ids_only)."""
        child = self.children[0]
        first = not self._sent
        done = child.finished
        if not done and len(child.output_token_ids) == (0 if first else self._sent[0][0]):
            return None
        out = CompletionOutput(child.index, "", self._take_ids(), finish_reason=child.finish_reason,
                               stop_reason=child.stop_reason)
        return RequestOutput(self.request_id, self.prompt if first else None, self.prompt_token_ids if first else [],
                             [out], done, self.prompt_logprobs if first else None,
                             num_cached_tokens=max(0, child.num_cached_tokens))

    def output(self) -> RequestOutput:
        self.finish_text()
        outs = []
        for i, (child, detok) in enumerate(zip(self.children, self.detoks)):
            text = detok.output_text if detok is not None else ""
            lps = self.logprobs[i] if self.logprobs else None
            outs.append(CompletionOutput(
                child.index, text, list(child.output_token_ids),
                cumulative_logprob=self.cumulative[i] if lps is not None else None,
                logprobs=list(lps) if lps is not None else None,
                finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        done = all(c.finished for c in self.children)
        cached = max(0, self.children[0].num_cached_tokens)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, done, self.prompt_logprobs,
                             num_cached_tokens=cached)


class LogprobRows:
    """Host lists of one LogprobsTensors (a step's sampled-token or prompt logprobs)."""

    def __init__(self, tensors: LogprobsTensors) -> None:
        self.top_ids = tensors.top_ids.tolist()
        self.top_logprobs = tensors.top_logprobs.tolist()
        self.token_logprob = tensors.token_logprob.tolist()
        self.token_rank = tensors.token_rank.tolist()

    def entry(self, n: int, token: int, k: int, decode: Any) -> dict[int, Logprob]:
        """The sampled/actual token first, then the top k (vLLM's layout)."""
        out = {token: Logprob(self.token_logprob[n], self.token_rank[n], decode(token))}
        for rank, (tid, lp) in enumerate(zip(self.top_ids[n][:k], self.top_logprobs[n][:k]), start=1):
            out.setdefault(tid, Logprob(lp, rank, decode(tid)))
        return out


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def _decode(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def process(self, parents: dict[str, ParentRequest], changed: list[tuple[int, Request, int]],
                result: StepOutput, finish: Any, deltas: TokenDeltas | None = None) -> list[RequestOutput]:
        """Fold one step's results into the parents; `finish(req, reason, stop)` ends a request on a stop string.
        With `deltas`, a report that is only new token ids goes there instead of into a RequestOutput.
        `changed`: (batch row, request, new tokens), the new tokens at the end of req.output_token_ids; a stop
        string inside a run of several tokens (speculative decoding) drops the run's later tokens."""
        lp = LogprobRows(result.logprobs) if result.logprobs is not None else None
        first_row = result.spec.first_row if result.spec is not None else None
        self._prompt_logprobs(parents, result)
        touched: dict[str, ParentRequest] = {}
        for b, req, num_new in changed:
            parent = parents.get(req.parent_id)
            if parent is None:
                continue
            touched[parent.request_id] = parent
            if req.finish_reason == "error" or num_new == 0:
                continue
            run = req.output_token_ids[len(req.output_token_ids) - num_new:]
            detok = parent.detoks[req.index]
            if isinstance(detok, DeferredDetokenizer):  # no stop strings to look for: nothing to do per token
                detok.update(run)
                detok = None
            want_logprobs = lp is not None and req.params.logprobs is not None
            if detok is None and not want_logprobs:
                continue
            for i, token in enumerate(run):
                if want_logprobs:
                    row = first_row[b] + i if first_row is not None else b
                    entry = lp.entry(row, token, req.params.logprobs, self._decode)  # type: ignore[union-attr]
                    parent.logprobs[req.index].append(entry)  # type: ignore[union-attr]
                    parent.cumulative[req.index] += entry[token].logprob
                if detok is not None:
                    stop = detok.update([token])
                    if stop is not None:
                        del req.output_token_ids[len(req.output_token_ids) - (len(run) - 1 - i):]
                        finish(req, "stop", stop)
                        break
        # what can fail (decoding a finished text) before any parent is reported and forgotten
        for parent_id in {req.parent_id for _, req, _ in changed if req.finished}:
            if parent_id in touched:
                touched[parent_id].finish_text()
        results_out = []
        for rid, parent in touched.items():
            if parent.final_only and not all(c.finished for c in parent.children):
                continue
            if deltas is not None:
                ids = parent.token_delta()
                if ids is not None:
                    if ids:
                        deltas.request_ids.append(rid)
                        deltas.token_ids.append(ids)
                    continue
            out = parent.report()
            if out is None:
                continue
            if out.finished:
                del parents[rid]
            results_out.append(out)
        return results_out

    def _prompt_logprobs(self, parents: dict[str, ParentRequest], result: StepOutput) -> None:
        if result.prompt_logprobs is None:
            return
        rows = LogprobRows(result.prompt_logprobs)
        n = 0
        for span in result.prompt_logprob_spans:
            parent = parents.get(span.parent_id)
            if parent is not None and parent.prompt_logprobs is not None:
                k = parent.children[0].params.prompt_logprobs or 0
                for i in range(span.count):
                    pos = span.first + i + 1
                    parent.prompt_logprobs[pos] = rows.entry(n + i, parent.prompt_token_ids[pos], k, self._decode)
            n += span.count
