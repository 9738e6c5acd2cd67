"""`FlexibleArgumentParser` (vLLM's name): argparse that also accepts vLLM's command-line spellings, so scripts
written against vLLM's command lines parse unchanged: `--flag_name` for `--flag-name`, `-O3` / `-O 3` for
`--compilation-config 3`, dotted JSON fields (`--compilation-config.cudagraph_mode FULL`) and `--config FILE`
(a YAML mapping of flag names to values, read before the command line, which wins)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def json_value(text: str) -> Any:
    """A JSON flag value (argparse type); a bare number stays a number (`--compilation-config 3`, `-O3`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        return super().parse_args(self._normalise(args), namespace)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        return super().parse_known_args(self._normalise(args), namespace)

    def _normalise(self, args: Sequence[str] | None) -> list[str]:
        argv = [_dashes(a) for a in (sys.argv[1:] if args is None else args)]
        if "--config" not in self._option_string_actions:
            argv = _expand_config(argv)
        if "--compilation-config" in self._option_string_actions:
            argv = _expand_optimisation_level(argv)
        return _gather_dotted(argv)


def _dashes(arg: str) -> str:
    """--max_model_len=5 -> --max-model-len=5 (values and positional arguments untouched)."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


def _expand_config(argv: list[str]) -> list[str]:
    """`--config FILE` -> the file's `key: value` pairs as flags, ahead of the rest of the command line."""
    out: list[str] = []
    from_file: list[str] = []
    it = iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if name != "--config":
            out.append(arg)
            continue
        path = Path(value if sep else next(it, ""))
        from_file += _config_flags(path)
    return from_file + out


def _config_flags(path: Path) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it as YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def _expand_optimisation_level(argv: list[str]) -> list[str]:
    """-O3 / -O 3 / -O={"level": 3} -> --compilation-config VALUE (vLLM's shorthand)."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "-O":
            out += ["--compilation-config", next(it, "")]
        elif arg.startswith("-O") and not arg.startswith("--"):
            out += ["--compilation-config", arg[2:].lstrip("=")]
        else:
            out.append(arg)
    return out


def _gather_dotted(argv: list[str]) -> list[str]:
    """--compilation-config.cudagraph_mode FULL -> --compilation-config '{"cudagraph_mode": "FULL"}'."""
    out: list[str] = []
    fields: dict[str, dict[str, Any]] = {}
    it = iter(argv)
    for arg in it:
        name, sep, value = arg.partition("=")
        if not (name.startswith("--") and "." in name):
            out.append(arg)
            continue
        flag, key = name.split(".", 1)
        raw = value if sep else next(it, "")
        try:
            parsed: Any = json.loads(raw)
        except json.JSONDecodeError:
            parsed = raw
        if flag not in fields:
            fields[flag] = {}
            out += [flag, ""]  # placeholder, filled below
        fields[flag][key.replace("-", "_")] = parsed
    for i, arg in enumerate(out):
        if arg in fields and i + 1 < len(out) and out[i + 1] == "":
            out[i + 1] = json.dumps(fields[arg])
    return out
