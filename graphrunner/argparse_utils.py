"""`FlexibleArgumentParser` (vLLM's name): argparse that also accepts `--flag_name` for `--flag-name` and
`--flag=value`, so scripts written against vLLM's command lines parse unchanged."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_args([_dashes(a) for a in args], namespace)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashes(a) for a in args], namespace)


def _dashes(arg: str) -> str:
    """--max_model_len=5 -> --max-model-len=5 (values and positional arguments untouched)."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
