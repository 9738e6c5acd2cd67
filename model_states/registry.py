"""Lazy registry: HF `architectures[0]` name -> "module:Class" of its ModelState, imported on first use.

Adding an architecture = one model file, one ModelState file and one line here.
"""

from __future__ import annotations

import importlib

from model_states.base import ModelState

_REGISTRY: dict[str, str] = {
    "Qwen3ForCausalLM": "model_states.qwen3:Qwen3ModelState",
    "LlamaForCausalLM": "model_states.llama:LlamaModelState",
    "Qwen2ForCausalLM": "model_states.qwen2:Qwen2ModelState",
    "MistralForCausalLM": "model_states.mistral:MistralModelState",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_state(architecture: str) -> type[ModelState]:
    """The ModelState class for an HF architecture name; ValueError listing the supported ones."""
    target = _REGISTRY.get(architecture)
    if target is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, ModelState)):
        raise TypeError(f"registry entry {target!r} for {architecture!r} is not a ModelState subclass")
    return cls
