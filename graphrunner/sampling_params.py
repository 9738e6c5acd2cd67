"""SamplingParams and RequestOutputKind: vLLM's per-request generation settings, validated on construction.

Inputs are normalised as vLLM's SamplingParams normalises them, so code written for vLLM runs unchanged:

* a single string for `stop` or `bad_words` is one entry; `stop_token_ids` and `bad_words` are deduplicated;
* `seed=-1` means unseeded (None); other seeds must be integers in [0, 2**63);
* `logprobs` / `prompt_logprobs`: True means 1, False means None;
* `top_k`: 0 and -1 both mean off; a value beyond the vocabulary is resolved to off where the vocabulary is
  known (`sampling.batch.prepare_request_sampling`; the state table clamps what it stores to int32);
* a temperature below 1e-5 means greedy (temperature 0, top_p 1, top_k 0, min_p 0); one in [1e-5, 1e-2) is
  raised to 1e-2 with a warning, vLLM's guard against inf/NaN from dividing by a tiny temperature. (Current
  vLLM raises all of (0, 1e-2) to 1e-2 before its greedy check, so there only 0 is greedy; here a temperature
  below 1e-5 is greedy, the limit it approximates, on purpose.)
* `clone()` is a deep copy; `from_optional(**kwargs)` treats None as "the default" (for fields that cannot be
  None) and turns string logit_bias keys into ints, clamping biases to [-100, 100].

Every other bad value is refused with a ValueError naming the field and the value, also a value of the wrong
type (a bool for an int field, a bare int for a list): callers catch ValueError for bad requests. Fields whose
sampling stages are not built yet are refused at submission by `unsupported_features()`, never silently ignored.
`output_kind` is carried for the front end (which decides how outputs are streamed).
"""

from __future__ import annotations

import copy
import logging
import math
import re
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_MAX_TEMP = 1e-2      # smaller positive temperatures are raised to this (vLLM's _MAX_TEMP)
_SEED_LIMIT = 1 << 63  # seeds are int64 on the device: [0, 2**63)
_MAX_LOGPROBS = 20
_BOOL_FIELDS = ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_INT_STRING = re.compile(r"-?[0-9]+")


class RequestOutputKind(Enum):
    """How a request's outputs are reported while it runs (vLLM's enum, same values)."""

    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1       # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # no intermediate outputs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name: str, value: Any, low: int) -> None:
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _finite(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _as_list(name: str, value: Any) -> list[Any]:
    """A copy of a list / tuple field; anything else (a bare value, a dict, a set of unknown order) is refused."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(value).__name__} {value!r}")
    return list(value)


def _token_ids(name: str, value: Any) -> list[int]:
    ids = _as_list(name, value)
    bad = [t for t in ids if not _is_int(t) or t < 0]
    if bad:
        raise ValueError(f"{name} must hold non-negative integer token ids, got {bad[:5]!r} in {value!r}")
    return ids


def _strings(name: str, value: Any, blank_ok: bool) -> list[str]:
    """None -> [], one string -> [it], else a list of non-empty strings, deduplicated in order (as vLLM)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else _as_list(name, value)
    bad = [s for s in items if not isinstance(s, str) or not (s if blank_ok else s.strip())]
    if bad:
        raise ValueError(f"{name} must hold non-empty{'' if blank_ok else ', non-blank'} strings, "
                         f"got {bad[:5]!r} in {value!r}")
    return list(dict.fromkeys(items))


def _is_token_key(key: Any) -> bool:
    """A logit_bias key: an int, or a string of decimal digits (JSON object keys are strings)."""
    return _is_int(key) or (isinstance(key, str) and _INT_STRING.fullmatch(key) is not None)


def _check_logit_bias(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(
            f"logit_bias must be a dict of token id -> bias, got {type(value).__name__} {value!r}")
    bad = [k for k in value if not _is_token_key(k)]
    if bad:
        raise ValueError(f"logit_bias keys must be integer token ids, got {bad[:5]!r}")
    for key, bias in value.items():
        _finite(f"logit_bias[{key!r}]", bias)


def _logprob_count(value: Any) -> Any:
    """vLLM's bool shorthand: True asks for 1, False for none."""
    if value is True:
        return 1
    return None if value is False else value


@dataclass
class SamplingParams:
    """Generation settings of one request (names, defaults and meaning as in vLLM)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off (as vLLM); beyond the vocabulary = off
    min_p: float = 0.0
    seed: int | None = None  # -1 = None = unseeded
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: str | list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        self.logprobs = _logprob_count(self.logprobs)
        self.prompt_logprobs = _logprob_count(self.prompt_logprobs)
        self.stop = _strings("stop", self.stop, blank_ok=True)  # "\n" is a common stop string
        self.bad_words = _strings("bad_words", self.bad_words, blank_ok=False)
        stop_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = list(dict.fromkeys(_token_ids("stop_token_ids", stop_ids)))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        self._validate_numbers()
        self._validate_rest()
        if self.temperature < _SAMPLING_EPS:  # greedy, as vLLM
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        elif self.temperature < _MAX_TEMP:
            logger.warning("temperature %s is below %s, which may produce inf/NaN; raised to %s (as vLLM)",
                           self.temperature, _MAX_TEMP, _MAX_TEMP)
            self.temperature = _MAX_TEMP

    def _validate_numbers(self) -> None:
        _int("n", self.n, 1)
        if self.best_of is not None:
            _int("best_of", self.best_of, self.n)
        for name in _FLOAT_FIELDS:
            _finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**63), or -1 / None for unseeded, got {self.seed!r}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, 0)
                if value > _MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {_MAX_LOGPROBS}, got {value}")
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)

    def _validate_rest(self) -> None:
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings are only supported when detokenize is True (stop={self.stop!r}, "
                             "detokenize=False)")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (use None to allow every token)")
        _check_logit_bias(self.logit_bias)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def clone(self) -> SamplingParams:
        """A deep copy (as vLLM's clone): changing the copy's lists or dicts leaves this one as it is."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments where None means "the default" (vLLM's from_optional, for API servers).

        None is kept for fields where it has a meaning (seed, max_tokens, logprobs, ...). String logit_bias
        keys become ints and biases are clamped to [-100, 100], as vLLM does.
        """
        no_none = {f.name for f in fields(cls) if "None" not in str(f.type)}
        kwargs = {k: v for k, v in kwargs.items() if not (v is None and k in no_none)}
        bias = kwargs.get("logit_bias")
        if bias is not None:
            _check_logit_bias(bias)
            kwargs["logit_bias"] = {int(k): min(100.0, max(-100.0, float(v))) for k, v in bias.items()}
        return cls(**kwargs)

    def unsupported_features(self) -> list[str]:
        """Settings the engine refuses at submission (as vLLM's V1 engine does for best_of)."""
        return ["best_of"] if self.best_of is not None and self.best_of != self.n else []
