"""Loading the tokenizer from a local model directory (never from the network)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None when it ships none (token-id prompts still work)."""
    tokenizer_dir = Path(tokenizer_dir)
    if not any((tokenizer_dir / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types here; name the directory in one clear error
        raise ValueError(f"could not load the tokenizer in {tokenizer_dir}: {exc}") from exc
