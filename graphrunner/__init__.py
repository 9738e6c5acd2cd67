"""graphrunner: a low-latency LLM runner for Hugging Face-format decoder models.

Public API (vLLM-compatible names): `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`.
They load lazily (module `__getattr__`), so importing a core module never pulls in the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "graphrunner.llm",
    "SamplingParams": "graphrunner.sampling_params",
    "RequestOutput": "graphrunner.outputs",
    "CompletionOutput": "graphrunner.outputs",
}
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from graphrunner.llm import LLM
    from graphrunner.outputs import CompletionOutput, RequestOutput
    from graphrunner.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
