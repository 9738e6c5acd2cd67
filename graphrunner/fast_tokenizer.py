"""A tokenizer read straight from tokenizer.json with the `tokenizers` library, so an engine starts without
importing transformers (on a device without bytecode caches that import alone costs seconds).

Only the generic fast class is read this way (`tokenizer_class` PreTrainedTokenizerFast / TokenizersBackend,
where transformers itself uses tokenizer.json as saved); graphrunner/tokenizer.py sends every other directory
to AutoTokenizer. encode/decode/token lookups run here, the way transformers' fast tokenizer runs them; any
other attribute (chat templates, `all_special_ids`, `vocab_size`, ...) comes from the full transformers
tokenizer, built on first use, so the behaviour is transformers' own.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# The classes whose transformers loader keeps tokenizer.json's pipeline as saved (model-specific classes may
# rebuild normalizers, pre-tokenizers or vocabularies from their own code).
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# transformers may patch the pre-tokenizer regex of a vocabulary over 100k ids (Mistral's): such a vocabulary loads
# here only when the directory is not a Mistral-family model and does not ask for the patch (`fix_mistral_regex`)
_MAX_VOCAB = 100_000
_MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, special: bool) -> Any:
    from tokenizers import AddedToken

    if isinstance(value, Mapping):
        fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=bool(value.get("special", special)), **fields)
    return AddedToken(value, special=special)


def fast_path_config(tokenizer_dir: Path) -> dict[str, Any] | None:
    """tokenizer_config.json's contents when this directory can load without transformers, else None."""
    if not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    path = tokenizer_dir / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError, RecursionError):
        return None  # the slow path names the broken file
    if not isinstance(config, dict) or config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens"):
        return None  # transformers post-processes decode / encode in Python for these
    return config


def _regex_may_be_patched(tokenizer_dir: Path, config: dict[str, Any]) -> bool:
    """Whether transformers could rewrite this large vocabulary's pre-tokenizer (its Mistral regex fix): the
    directory asks for the fix, or its config.json names a Mistral-family model (or cannot be read)."""
    if "fix_mistral_regex" in config:
        return True
    path = tokenizer_dir / "config.json"
    if not path.is_file():
        return False  # transformers looks for the model type in config.json only
    try:
        model_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return True
    return not isinstance(model_config, dict) or model_config.get("model_type") in _MISTRAL_TYPES


class FastTokenizer:
    """encode/decode as transformers' PreTrainedTokenizerFast over the same tokenizer.json; every other attribute
    from the real transformers tokenizer (`hf_tokenizer`), loaded on first use."""

    is_fast = True

    def __init__(self, tokenizer_dir: Path, config: dict[str, Any], load_hf: Callable[[], Any]) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(tokenizer_dir)
        self._load_hf = load_hf
        self._hf: Any = None
        self._hf_lock = threading.Lock()
        backend = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        if backend.get_vocab_size(with_added_tokens=True) > _MAX_VOCAB and _regex_may_be_patched(tokenizer_dir, config):
            raise NotFast("large Mistral-family vocabulary (transformers may patch its regex)")
        if backend.truncation is not None or backend.padding is not None:
            raise NotFast("tokenizer.json sets truncation or padding")
        # What transformers adds at load: the config's added tokens, then named and extra special tokens
        # the backend lacks (as special tokens).
        present = set(backend.get_vocab(with_added_tokens=True))
        to_add: list[Any] = []
        for _, value in sorted(((int(i), v) for i, v in (config.get("added_tokens_decoder") or {}).items())):
            text = _token_text(value)
            if text is not None and text not in present:
                to_add.append(_added_token(value, special=False))
                present.add(text)
        specials: dict[str, str | None] = {name: _token_text(config.get(name)) for name in _NAMED_SPECIAL}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        extra_values = list(extra.values()) if isinstance(extra, Mapping) else list(extra)
        for value in [config.get(name) for name in _NAMED_SPECIAL] + extra_values:
            text = _token_text(value)
            if text is not None and text not in present:
                to_add.append(_added_token(value, special=True))
                present.add(text)
        if to_add:
            backend.add_tokens(to_add)
        self._specials = specials
        # transformers may rewrite the post-processor from add_bos_token / add_eos_token (and how has changed
        # between its versions): a directory asking for either, or naming them beside a post-processor that adds
        # tokens, loads the slow way.
        post = backend.post_processor
        if config.get("add_bos_token") or config.get("add_eos_token"):
            raise NotFast("add_bos_token / add_eos_token")
        if ("add_bos_token" in config or "add_eos_token" in config) and post is not None and (
                post.num_special_tokens_to_add(False) or post.num_special_tokens_to_add(True)):
            raise NotFast("add_bos_token / add_eos_token beside a post-processor that adds tokens")
        backend.encode_special_tokens = False
        self._tokenizer = backend  # the name transformers uses: graphrunner.detokenizer decodes with it directly

    # -- the hot path, answered here ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif not isinstance(token_ids, list):
            token_ids = list(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list[str]:
        if isinstance(ids, int) and not skip_special_tokens:
            return self._tokenizer.id_to_token(ids)
        return self.hf_tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        return self.hf_tokenizer.convert_tokens_to_ids(tokens)

    @property
    def eos_token(self) -> str | None:
        return self._specials["eos_token"]

    @property
    def bos_token(self) -> str | None:
        return self._specials["bos_token"]

    @property
    def eos_token_id(self) -> int | None:
        eos = self._specials["eos_token"]
        return None if eos is None else self._tokenizer.token_to_id(eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self._specials["bos_token"]
        return None if bos is None else self._tokenizer.token_to_id(bos)

    # -- everything else: transformers' tokenizer ------------------------------------------------------------
    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer of the same directory (loaded once, on first use)."""
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    self._hf = self._load_hf()
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_hf", "_load_hf", "_hf_lock", "_tokenizer", "_specials"):
            raise AttributeError(name)  # (copy/pickle probes, and lookups before __init__ finished)
        return getattr(self.hf_tokenizer, name)

    def __len__(self) -> int:
        return len(self.hf_tokenizer)

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r})"


class NotFast(Exception):
    """This directory needs transformers' own loading (the reason is the message)."""
