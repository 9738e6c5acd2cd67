"""Turning one step's host results into user-visible state: detokenized text, stop strings,
logprobs and prompt logprobs, and the RequestOutput of each touched request.

Runs on the host after the step's outputs arrived; it never touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.detokenizer import IncrementalDetokenizer
from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput
from graphrunner.request import Request


@dataclass
class ParentRequest:
    """A user request: its prompt and its n child sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    logprobs: list[list[dict[int, Logprob]] | None] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def output(self) -> RequestOutput:
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
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, done, self.prompt_logprobs)


class LogprobRows:
    """Host copies of one LogprobsTensors (prefix 'lp' or 'plp' in a step's results)."""

    def __init__(self, results: dict[str, torch.Tensor], prefix: str) -> None:
        self.top_ids = results[f"{prefix}.top_ids"].tolist()
        self.top_logprobs = results[f"{prefix}.top_logprobs"].tolist()
        self.token_logprob = results[f"{prefix}.token_logprob"].tolist()
        self.token_rank = results[f"{prefix}.token_rank"].tolist()

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

    def process(self, parents: dict[str, ParentRequest], changed: list[tuple[int, Request]],
                results: dict[str, torch.Tensor], info: dict[str, object],
                finish: Any) -> list[RequestOutput]:
        """Fold one step's results into the parents; `finish(req, reason, stop)` ends a request on a stop string."""
        lp = LogprobRows(results, "lp") if "lp.top_ids" in results else None
        self._prompt_logprobs(parents, results, info)
        touched: dict[str, ParentRequest] = {}
        for b, req in changed:
            parent = parents.get(req.parent_id)
            if parent is None:
                continue
            touched[parent.request_id] = parent
            if req.finish_reason == "error":
                continue
            token = req.output_token_ids[-1]
            if lp is not None and req.params.logprobs is not None:
                entry = lp.entry(b, token, req.params.logprobs, self._decode)
                parent.logprobs[req.index].append(entry)  # type: ignore[union-attr]
                parent.cumulative[req.index] += entry[token].logprob
            detok = parent.detoks[req.index]
            if detok is not None:
                stop = detok.update([token])
                if stop is not None:
                    finish(req, "stop", stop)
        results_out = []
        for rid, parent in touched.items():
            out = parent.output()
            if out.finished:
                del parents[rid]
            results_out.append(out)
        return results_out

    def _prompt_logprobs(self, parents: dict[str, ParentRequest], results: dict[str, torch.Tensor],
                         info: dict[str, object]) -> None:
        spans = info.get("prompt_logprob_spans")
        if not spans:
            return
        rows = LogprobRows(results, "plp")
        n = 0
        for _b, first, count, parent_id in spans:  # type: ignore[attr-defined]
            parent = parents.get(parent_id)
            if parent is not None and parent.prompt_logprobs is not None:
                k = parent.children[0].params.prompt_logprobs or 0
                for i in range(count):
                    token = parent.prompt_token_ids[first + i + 1]
                    parent.prompt_logprobs[first + i + 1] = rows.entry(n + i, token, k, self._decode)
            n += count
