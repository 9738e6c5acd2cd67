"""The tokenizers-only tokenizer (graphrunner/fast_tokenizer.py) against transformers' AutoTokenizer on the same
directory: encode, decode, token lookups, special tokens and chat templates agree, loading imports no transformers,
and directories it cannot serve exactly still load through AutoTokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_models import EOS_TOKEN, tiny_tokenizer

from graphrunner.detokenizer import IncrementalDetokenizer
from graphrunner.fast_tokenizer import FastTokenizer
from graphrunner.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "graphrunner" / "demo_model"
ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["", "hello", "Hello world! How are you today?", "  leading and trailing  ", "tabs\tand\nnewlines\n\n",
         "unicode: naïve café 日本語 🙂", "1, 2, 3, 42 and 1000", f"special {EOS_TOKEN} inside{EOS_TOKEN}",
         "<|im_start|>user\nhi<|im_end|>\n", "<|extra_0|> and <|not special|>x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _save_tiny(path: Path, **config_updates: Any) -> Path:
    tiny_tokenizer().save_pretrained(path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config_updates)
    cfg_path.write_text(json.dumps(cfg))
    return path


def _hf(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def _variants(tmp_path: Path) -> dict[str, Path]:
    return {
        "demo": DEMO,
        "tiny": _save_tiny(tmp_path / "tiny"),
        "tiny-no-add": _save_tiny(tmp_path / "noadd", add_bos_token=False, add_eos_token=False),
        "tiny-added-tokens": _save_tiny(
            tmp_path / "added", additional_special_tokens=["<|extra_0|>", "<|im_start|>"], unk_token="<|unk|>",
            added_tokens_decoder={"401": {"content": "<|not special|>", "special": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "single_word": False}},
            chat_template=TEMPLATE),
    }


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    out = {}
    for name, path in _variants(tmp_path_factory.mktemp("toks")).items():
        fast = load_tokenizer(path)
        assert isinstance(fast, FastTokenizer), name
        out[name] = (fast, _hf(path))
    return out


VARIANTS = ["demo", "tiny", "tiny-no-add", "tiny-added-tokens"]


@pytest.mark.parametrize("name", VARIANTS)
def test_encode_matches_autotokenizer(pairs: dict[str, tuple[Any, Any]], name: str) -> None:
    fast, hf = pairs[name]
    for text in TEXTS:
        for add in (True, False):
            assert fast.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), (text, add)
        assert fast.encode(text) == hf.encode(text)
    assert fast.encode("abc", add_special_tokens=False, truncation=True, max_length=2) == \
        hf.encode("abc", add_special_tokens=False, truncation=True, max_length=2)  # extra kwargs: transformers' own


@pytest.mark.parametrize("name", VARIANTS)
def test_decode_and_lookups_match_autotokenizer(pairs: dict[str, tuple[Any, Any]], name: str) -> None:
    import random

    fast, hf = pairs[name]
    rng = random.Random(0)
    n = len(hf)
    id_lists = [hf.encode(t) for t in TEXTS] + [[rng.randrange(n) for _ in range(rng.randrange(1, 30))]
                                                 for _ in range(50)]
    for ids in id_lists:
        for skip in (False, True):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert fast.decode(5) == hf.decode(5)
    assert fast.decode(id_lists[2], clean_up_tokenization_spaces=True) == \
        hf.decode(id_lists[2], clean_up_tokenization_spaces=True)
    assert [fast.convert_ids_to_tokens(i) for i in range(n)] == [hf.convert_ids_to_tokens(i) for i in range(n)]
    assert fast.convert_ids_to_tokens(list(range(n)), skip_special_tokens=True) == \
        hf.convert_ids_to_tokens(list(range(n)), skip_special_tokens=True)
    for attr in ("eos_token", "eos_token_id", "bos_token", "bos_token_id", "pad_token_id", "all_special_ids",
                 "all_special_tokens", "vocab_size"):
        assert getattr(fast, attr) == getattr(hf, attr), attr
    assert len(fast) == len(hf)
    assert fast.get_vocab() == hf.get_vocab()


@pytest.mark.parametrize("name", ["demo", "tiny-added-tokens"])
def test_chat_template_matches_autotokenizer(pairs: dict[str, tuple[Any, Any]], name: str) -> None:
    fast, hf = pairs[name]
    assert fast.chat_template == hf.chat_template
    for gen in (True, False):
        text = fast.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert fast.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["demo", "tiny-added-tokens"])
def test_incremental_detokenizer_matches(pairs: dict[str, tuple[Any, Any]], name: str) -> None:
    fast, hf = pairs[name]
    prompt = hf.encode("Hello world!")
    generated = hf.encode(" naïve café 🙂" + (hf.eos_token or "") + " and more text, 42.")
    for skip in (True, False):
        texts = []
        for tok in (fast, hf):
            d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            for t in generated:
                d.update([t])
            d.finish()
            texts.append(d.output_text)
        assert texts[0] == texts[1] == hf.decode(generated, skip_special_tokens=skip)


def test_loading_imports_no_transformers() -> None:
    code = ("import sys; from graphrunner.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({str(DEMO)!r}); ids = t.encode('hello world'); t.decode(ids); "
            "assert type(t).__name__ == 'FastTokenizer', type(t); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('transformers', 'huggingface_hub')], 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120,
                   env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("update", [{"tokenizer_class": "Qwen2Tokenizer"}, {"clean_up_tokenization_spaces": True},
                                    {"tokenizer_class": "EvilTokenizer"},
                                    {"bos_token": EOS_TOKEN, "add_bos_token": True, "add_eos_token": True}])
def test_other_directories_load_through_autotokenizer(tmp_path: Path, update: dict[str, Any]) -> None:
    path = _save_tiny(tmp_path / "t", **update)
    tok = load_tokenizer(path)
    assert not isinstance(tok, FastTokenizer)
    assert tok.encode("Hello world!") == _hf(path).encode("Hello world!")


def test_broken_tokenizer_json_still_names_the_file(tmp_path: Path) -> None:
    path = _save_tiny(tmp_path / "t")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(path)


def _save_large(path: Path, model_type: str, **config_updates: Any) -> Path:
    """A byte-level vocabulary over 100k ids (Qwen's and Llama 3's are) beside a config.json naming `model_type`."""
    sys.path.insert(0, str(ROOT / "tools"))
    from make_bench_model import synthetic_tokenizer

    synthetic_tokenizer(100_300).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "transformers_version": "4.51.0"}))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(config_updates)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_large_vocabulary_loads_fast_unless_mistral(tmp_path: Path) -> None:
    """A large non-Mistral vocabulary takes the fast path and agrees with AutoTokenizer; a Mistral-family one, or one
    asking for transformers' regex fix, loads through AutoTokenizer (which may rewrite its pre-tokenizer)."""
    path = _save_large(tmp_path / "qwen", "qwen3")
    fast, hf = load_tokenizer(path), _hf(path)
    assert isinstance(fast, FastTokenizer)
    for text in TEXTS:
        ids = fast.encode(text)
        assert ids == hf.encode(text), text
        assert fast.decode(ids) == hf.decode(ids)
    high = list(range(100_000, 100_300))
    assert fast.decode(high) == hf.decode(high)
    assert not isinstance(load_tokenizer(_save_large(tmp_path / "mistral", "mistral")), FastTokenizer)
    assert not isinstance(load_tokenizer(_save_large(tmp_path / "fix", "qwen3", fix_mistral_regex=False)), FastTokenizer)
