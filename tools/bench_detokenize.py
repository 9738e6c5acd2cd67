"""Detokenizer micro-benchmark: host cost per generated token, old (transformers decode) vs new (Rust decode).

256 sequences x 512 tokens of realistic text-like ids (an encoded long text, sliced at different offsets, the
preceding tokens as the prompt), fed one token per sequence per step as the engine does. "old" is the
detokenizer before this change (two `tokenizer.decode` calls through transformers' Python wrapper per token),
copied below; "new" is graphrunner.detokenizer.IncrementalDetokenizer; "new-python-path" is the new algorithm
forced through `tokenizer.decode` (what slow tokenizers get); "DecodeStream" is the bare
`tokenizers.decoders.DecodeStream.step` loop (no flush, stop strings or byte-fallback hold-back) for reference.
Prints a table and writes JSON. Example: python tools/bench_detokenize.py --json bench_detokenize.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from graphrunner.detokenizer import IncrementalDetokenizer
from graphrunner.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REPLACEMENT_CHAR = "\ufffd"


class OldIncrementalDetokenizer:
    """The pre-change decode loop (graphrunner/detokenizer.py at 06b730e), stop strings left out."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self._ids = list(prompt_token_ids[-5:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, spaces_between_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int]) -> None:
        self._ids.extend(new_token_ids)
        ids, end = self._ids, len(self._ids)
        full = self._decode(ids[self._prefix_offset:])
        if not full.endswith(REPLACEMENT_CHAR):
            self.output_text += self._emit(full, end)
            return
        for k in range(end - 1, max(self._read_offset, end - 4), -1):
            text = self._decode(ids[self._prefix_offset:k])
            if len(text) > len(self._prefix_text) and full[:-1].startswith(text):
                self.output_text += self._emit(text, k)
                return

    def _emit(self, window_text: str, new_read_offset: int) -> str:
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, new_read_offset
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return delta


class PythonPath:
    """Not a fast tokenizer: makes IncrementalDetokenizer decode through `tokenizer.decode`."""

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._inner.decode(ids, **kwargs)


class StreamOnly:
    """The bare DecodeStream loop."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer._tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-5:]), skip_special_tokens=True)
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> None:
        for t in new_token_ids:
            text = self._stream.step(self._backend, t)
            if text is not None:
                self.output_text += text


def _workload(tokenizer: Any, batch: int, tokens: int) -> list[tuple[list[int], list[int]]]:
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < 64 + tokens + batch * 37:
        ids = ids + ids
    out = []
    for i in range(batch):
        start = 64 + i * 37
        out.append((ids[start - 64 : start], ids[start : start + tokens]))
    return out


def _run_once(make: Any, work: list[tuple[list[int], list[int]]], tokens: int) -> tuple[float, list[str]]:
    dets = [make(prompt) for prompt, _ in work]
    t0 = time.perf_counter()
    for step in range(tokens):  # step-major, like the engine's output processor
        for det, (_, gen) in zip(dets, work):
            det.update([gen[step]])
    elapsed = time.perf_counter() - t0
    return elapsed, [d.output_text for d in dets]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="bench_detokenize.json")
    args = ap.parse_args()
    tok = load_tokenizer(ROOT / "graphrunner" / "demo_model")
    work = _workload(tok, args.batch, args.tokens)
    variants = {
        "old": lambda p: OldIncrementalDetokenizer(tok, p),
        "new": lambda p: IncrementalDetokenizer(tok, p),
        "new-python-path": lambda p: IncrementalDetokenizer(PythonPath(tok), p),
        "DecodeStream": lambda p: StreamOnly(tok, p),
    }
    n_tokens = args.batch * args.tokens
    results: dict[str, Any] = {}
    texts: dict[str, list[str]] = {}
    for name, make in variants.items():
        times = []
        for _ in range(args.repeats):
            elapsed, texts[name] = _run_once(make, work, args.tokens)
            times.append(elapsed)
        results[name] = {"median_s": statistics.median(times), "runs_s": times,
                         "us_per_token": statistics.median(times) / n_tokens * 1e6}
    assert texts["new"] == texts["old"] == texts["new-python-path"], "variants disagree on the decoded text"
    base = results["old"]["us_per_token"]
    print(f"{args.batch} sequences x {args.tokens} tokens, median of {args.repeats}")
    print(f"{'variant':<18}{'us/token':>10}{'median s':>10}{'speed-up':>10}")
    for name, r in results.items():
        r["speedup_vs_old"] = base / r["us_per_token"]
        print(f"{name:<18}{r['us_per_token']:>10.2f}{r['median_s']:>10.3f}{r['speedup_vs_old']:>9.1f}x")
    Path(args.json).write_text(json.dumps({"batch": args.batch, "tokens": args.tokens, "repeats": args.repeats,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
