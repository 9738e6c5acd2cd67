"""Sampling defaults from a model's generation_config.json, as vLLM applies them (`generation_config="auto"`).

Only the fields vLLM takes over are read (temperature, top_k, top_p, min_p, repetition_penalty and
max_new_tokens as max_tokens); "vllm" means no defaults; any other value names a folder holding the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"


def generation_defaults(setting: str, model_dir: Path) -> dict[str, Any]:
    """SamplingParams keyword defaults for `generation_config=setting` ("auto", "vllm" or a folder)."""
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else Path(setting)
    if setting != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config={setting!r} is neither 'auto', 'vllm' nor a directory")
    path = folder / FILE_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return {ours: data[theirs] for theirs, ours in _FIELDS.items() if data.get(theirs) is not None}
