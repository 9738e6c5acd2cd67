"""Loading the tokenizer from a local model directory (never from the network, never running its code).

A generic fast tokenizer (tokenizer.json) loads with the `tokenizers` library alone (graphrunner/fast_tokenizer.py):
start-up then never imports transformers. Every other directory goes through AutoTokenizer.

`trust_remote_code=False` is passed explicitly, so a tokenizer_config.json / config.json `auto_map` is never
imported and transformers never prompts. A tokenizer that fails to load raises ValueError naming the
directory and, when one can be pinned down, the broken file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from graphrunner.fast_tokenizer import FastTokenizer, fast_path_config

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json", "vocab.json")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _json_problem(path: Path) -> str | None:
    """Why `path` is not a JSON object file, or None when it is one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, absurdly nested
        return f"is not a readable JSON file ({_one_line(exc)})"
    if not isinstance(data, dict):
        return f"must contain a JSON object, got {type(data).__name__}"
    return None


def _broken_file(tokenizer_dir: Path) -> tuple[Path, str] | None:
    """The first tokenizer file that is broken on its own (not JSON, or not a `tokenizers` file), if any."""
    for name in _JSON_FILES:
        path = tokenizer_dir / name
        problem = _json_problem(path) if path.is_file() else None
        if problem is not None:
            return path, problem
    path = tokenizer_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust parser raises plain Exception (missing/ill-typed fields)
            return path, f"is not a valid tokenizers file ({_one_line(exc)})"
    return None


def load_tokenizer(tokenizer_dir: Path, fast: bool = True) -> Any:
    """The directory's tokenizer, or None when it ships none (token-id prompts still work).

    A FastTokenizer where the directory allows one (and `fast`), else transformers' AutoTokenizer result."""
    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise ValueError(f"tokenizer path {str(tokenizer_dir)!r} is not a directory")
    if not any((tokenizer_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    config = fast_path_config(tokenizer_dir) if fast else None
    tokenizer = None
    if config is not None:
        try:
            tokenizer = FastTokenizer(tokenizer_dir, config, lambda: _load_hf(tokenizer_dir))
        except Exception:  # noqa: BLE001 - anything odd (NotFast included): transformers' loader decides, names errors
            tokenizer = None
    return tokenizer if tokenizer is not None else _load_hf(tokenizer_dir)


def _load_hf(tokenizer_dir: Path) -> Any:
    """AutoTokenizer on the directory, its failures turned into one ValueError naming the broken file."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types here; name the broken file in one clear error
        broken = _broken_file(tokenizer_dir)
        if broken is not None:
            path, problem = broken
            raise ValueError(f"could not load the tokenizer in {tokenizer_dir}: {path} {problem}") from exc
        raise ValueError(f"could not load the tokenizer in {tokenizer_dir}: {_one_line(exc)}") from exc
