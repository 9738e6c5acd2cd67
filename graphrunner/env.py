"""Reading graphrunner's GRAPHRUNNER_* environment switches: a number or a choice, validated, with an error that
names the variable and the value (a typo must not surface as a bare int() traceback or a kernel failure)."""

from __future__ import annotations

import os
from collections.abc import Callable


def env_number(name: str, default: float | None, *, integer: bool = False,
               valid: Callable[[float], bool] = lambda _: True, rule: str = "") -> float | None:
    """$name as a number (`default` when unset or empty); a ValueError saying what it must be ("a number" or "an
    integer", then `rule`, e.g. "> 0 (seconds)") when it does not parse or is not `valid`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    error = ValueError(f"{name} must be {'an integer' if integer else 'a number'}{' ' + rule if rule else ''}; "
                       f"got {raw!r}")
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise error from None
    if not valid(value):
        raise error
    return value


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """$name, lower-cased, one of `choices` (`default` when unset or empty); ValueError naming them otherwise."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
