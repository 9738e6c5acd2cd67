"""Speculative decoding configuration, vLLM's `speculative_config` dict resolved and validated.

Prompt lookup (`method="ngram"`), a draft model (`method="draft_model"`) and an EAGLE-1 head (`method="eagle"`,
`model` = the head's directory) are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "eagle")
MODEL_METHODS = ("draft_model", "eagle")  # the methods that load a model from `model`
_KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
               "model"}
MAX_SPEC_TOKENS = 16  # a verify step is 1 + k tokens per request: beyond this the waste dominates


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram", "draft_model" or "eagle"; k drafts per verify step; n-gram lengths tried from prompt_lookup_max
    down to prompt_lookup_min; no drafts are scheduled in a step whose running batch has >= disable_by_batch_size
    requests (None: never disabled), and a model proposer does not run in it: the requests in such a step finish
    without speculation, those admitted later speculate; model: the draft model's (draft_model) or EAGLE head's
    (eagle) directory."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported; built: {list(SPEC_METHODS)}")
        if (self.method in MODEL_METHODS) != (self.model is not None):
            raise ValueError(f"speculative_config 'model' (the draft model's or EAGLE head's directory) is needed by "
                             f"methods {list(MODEL_METHODS)} and only by them; method {self.method!r} "
                             f"{'needs it' if self.method in MODEL_METHODS else 'takes none'}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPEC_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be <= {MAX_SPEC_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)

    @classmethod
    def from_dict(cls, raw: Any) -> SpeculativeConfig:
        """vLLM's dict: `method` and `num_speculative_tokens` are required; a missing prompt_lookup bound takes
        the other's value, both missing give 5 (as vLLM)."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(raw).__name__}")
        unknown = sorted(set(raw) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"speculative_config keys {unknown} are not supported; known: {sorted(_KNOWN_KEYS)}")
        method = raw.get("method")
        if method is None:
            raise ValueError("speculative_config needs a 'method' (e.g. 'ngram')")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; built: {list(SPEC_METHODS)}")
        model = raw.get("model")
        if model is not None and not isinstance(model, str):
            model = str(model)  # a Path
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (drafts per verify step)")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        return cls(method, raw["num_speculative_tokens"], lo, hi, raw.get("disable_by_batch_size"), model)
