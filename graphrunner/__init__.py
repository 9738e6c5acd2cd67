"""graphrunner: a low-latency LLM runner for Hugging Face-format decoder models.

Public API (vLLM's names): `LLM`, `LLMEngine`, `EngineArgs`, `SamplingParams`, `RequestOutputKind`,
`RequestOutput`, `CompletionOutput`, `Logprob`, `TextPrompt`, `TokensPrompt`.
They load lazily (module `__getattr__`), so importing a core module never pulls in the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "graphrunner.llm",
    "LLMEngine": "graphrunner.llm_engine",
    "EngineArgs": "graphrunner.engine_args",
    "SamplingParams": "graphrunner.sampling_params",
    "RequestOutputKind": "graphrunner.sampling_params",
    "RequestOutput": "graphrunner.outputs",
    "CompletionOutput": "graphrunner.outputs",
    "Logprob": "graphrunner.outputs",
    "TextPrompt": "graphrunner.inputs",
    "TokensPrompt": "graphrunner.inputs",
}
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "Logprob", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "TextPrompt", "TokensPrompt"]

if TYPE_CHECKING:
    from graphrunner.engine_args import EngineArgs
    from graphrunner.inputs import TextPrompt, TokensPrompt
    from graphrunner.llm import LLM
    from graphrunner.llm_engine import LLMEngine
    from graphrunner.outputs import CompletionOutput, Logprob, RequestOutput
    from graphrunner.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
