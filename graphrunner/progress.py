"""The progress bar of `LLM.generate` / `LLM.chat`, with vLLM's fields: finished prompts of the call and the
estimated input and output token speeds. `use_tqdm` is a bool or a tqdm-like callable, as in vLLM."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from graphrunner.outputs import RequestOutput


class GenerateProgress:
    def __init__(self, total: int, use_tqdm: bool | Callable[..., Any]) -> None:
        self._bar: Any = None
        self._in = self._out = 0
        if not use_tqdm or total == 0:
            return
        if callable(use_tqdm):
            factory = use_tqdm
        else:
            from tqdm import tqdm as factory
        self._bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True, file=sys.stderr,
                            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")

    def finished(self, out: RequestOutput) -> None:
        if self._bar is None:
            return
        self._in += len(out.prompt_token_ids)
        self._out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = self._bar.format_dict.get("elapsed", 0) or 1e-9
        self._bar.postfix = (f"est. speed input: {self._in / elapsed:.2f} toks/s, "
                             f"output: {self._out / elapsed:.2f} toks/s")
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
