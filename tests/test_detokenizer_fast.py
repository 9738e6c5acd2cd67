"""Tests for the Rust-backed path of graphrunner.detokenizer against a full `tokenizer.decode` on every prefix.

Three fast tokenizers (nothing is downloaded): the tiny byte-level BPE of tests/tiny_models.py, byte-fallback
SentencePiece-style BPEs (Metaspace pre-tokenizer; ByteFallback + Fuse + Metaspace or Llama's Strip decoder)
trained here on a small multilingual text, and the shipped demo model's tokenizer. Each is also run through
the Python path (`tokenizer.decode`, as for slow tokenizers) via a wrapper object.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tiny_models import tiny_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from graphrunner.detokenizer import INITIAL_CONTEXT_TOKENS, DeferredDetokenizer, IncrementalDetokenizer, tokenizer_info
from graphrunner.tokenizer import load_tokenizer

FFFD = "\ufffd"
DEMO_DIR = Path(__file__).resolve().parents[1] / "graphrunner" / "demo_model"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Café, naïve, résumé, déjà vu: accents are common. Été à la plage, très élégant.",
    "中文文本也需要正确地解码。我们喜欢测试中文字符。日本語のテキスト。한국어 텍스트.",
    "Emoji: 😀 🎉 👍🏽 🚀 family 👨‍👩‍👧 flag 🇫🇷.",
    "def add(a, b):\n\treturn a + b\n",
]
SAMPLES = CORPUS + [
    "  leading spaces and\ttabs\nand newlines\n\n",
    "Unseen: 🦄🐉🧠 龍虎 ÅØÆ ñ ü 👩🏾‍🔬 🏳️‍🌈",
    "mixed 😀é中 text 🎉🎉🎉 end",
    " Hello world! The capital of Spain is Madrid.",
]


def _byte_fallback_tokenizer(strip_decoder: bool) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: `<0xNN>` byte tokens in the vocab, a small alphabet so rare characters fall back."""
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, limit_alphabet=50, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{i:02X}>": 3 + i for i in range(256)}
    for token in trained["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if strip_decoder:  # Llama / Mistral tokenizer.json
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    else:
        steps = [decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class PythonPath:
    """Delegates to a tokenizer but is no fast tokenizer: the detokenizer uses `tokenizer.decode` (slow path)."""

    def __init__(self, tokenizer: Any) -> None:
        self._inner = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._inner.decode(ids, **kwargs)


_TOKENIZERS: dict[str, Any] = {}


def _get(name: str) -> Any:
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = {
            "byte_level": tiny_tokenizer,
            "byte_fallback_metaspace": lambda: _byte_fallback_tokenizer(strip_decoder=False),
            "byte_fallback_strip": lambda: _byte_fallback_tokenizer(strip_decoder=True),
            "demo": lambda: load_tokenizer(DEMO_DIR),
        }[name]()
    return _TOKENIZERS[name]


NAMES = ["byte_level", "byte_fallback_metaspace", "byte_fallback_strip", "demo"]


@pytest.fixture(params=NAMES)
def tok(request: pytest.FixtureRequest) -> Any:
    return _get(request.param)


def _specials(tokenizer: Any) -> list[int]:
    return sorted(set(tokenizer.all_special_ids))


def _byte_ids(tokenizer: Any) -> list[int]:
    return sorted(tokenizer_info(tokenizer).byte_ids)


def _reference(tokenizer: Any, prompt: list[int], ids: list[int], skip: bool) -> str:
    """tokenizer.decode of the generated ids; with a prompt, the text they add after the prompt's last tokens."""
    ctx = prompt[-INITIAL_CONTEXT_TOKENS:]
    if not ctx:
        return tokenizer.decode(ids, skip_special_tokens=skip)
    head = tokenizer.decode(ctx, skip_special_tokens=skip)
    full = tokenizer.decode(ctx + ids, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def _open_run(tokenizer: Any, ids: list[int], skip: bool) -> bool:
    """Whether ids end in a run of byte-fallback tokens (special tokens inside it are invisible when skipped)."""
    byte_ids, hidden = set(_byte_ids(tokenizer)), set(_specials(tokenizer)) if skip else set()
    for t in reversed(ids):
        if t in byte_ids:
            return True
        if t not in hidden:
            return False
    return False


def check_every_prefix(tokenizer: Any, prompt: list[int], gen: list[int], skip: bool, fast: bool = True) -> None:
    """Incremental text vs full decode after each token; finishing after any prefix gives exactly the decode."""
    tk = tokenizer if fast else PythonPath(tokenizer)
    det = IncrementalDetokenizer(tk, prompt, skip_special_tokens=skip)
    assert det.uses_rust_decode == fast
    final = _reference(tokenizer, prompt, gen, skip)
    stream = []
    for n in range(1, len(gen) + 1):
        det.update(gen[n - 1 : n])
        stream.append(det.get_delta())
        ref = _reference(tokenizer, prompt, gen[:n], skip)
        out = det.output_text
        assert ref.startswith(out) and final.startswith(out), (gen[:n], out, ref)
        if not ref.endswith(FFFD) and not _open_run(tokenizer, gen[:n], skip):
            assert out == ref, (gen[:n], out, ref)  # nothing held back but an incomplete character
        finished = IncrementalDetokenizer(tk, prompt, skip_special_tokens=skip)
        finished.update(gen[:n])
        finished.finish()
        assert finished.output_text == ref, (gen[:n], finished.output_text, ref)
    stream.append(det.finish())
    assert det.output_text == final == "".join(stream)


def _sequences(tokenizer: Any, seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated) pairs: slices of encoded awkward text, special tokens spliced in, random ids."""
    rng = random.Random(seed)
    encoded = [tokenizer.encode(s, add_special_tokens=False) for s in SAMPLES]
    specials, byte_ids, vocab = _specials(tokenizer), _byte_ids(tokenizer), len(tokenizer)
    out = []
    for i in range(n):
        ids = list(rng.choice(encoded))
        for _ in range(rng.randrange(0, 3)):  # special tokens in the middle
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        if i % 3 == 2:  # random ids, some of them lone / invalid UTF-8 byte fragments
            pool = byte_ids or list(range(vocab))
            ids = [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        start = rng.randrange(0, max(1, len(ids) // 3))
        gen = ids[start : start + 40]
        prompt = encoded[rng.randrange(len(encoded))][:6] if rng.random() < 0.4 else []
        while prompt and prompt[-1] in byte_ids:  # real prompts end at a character (and byte-run) boundary
            prompt.pop()
        out.append((prompt, gen))
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_every_prefix_matches_full_decode(tok: Any, skip: bool) -> None:
    for prompt, gen in _sequences(tok, seed=int(skip), n=45):
        check_every_prefix(tok, prompt, gen, skip)


@pytest.mark.parametrize("name", NAMES)
def test_python_path_every_prefix(name: str) -> None:
    tok = _get(name)
    for prompt, gen in _sequences(tok, seed=7, n=8):
        check_every_prefix(tok, prompt, gen, skip=True, fast=False)


def test_awkward_texts_stream_without_replacement_chars(tok: Any) -> None:
    for s in SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        expected = tok.decode(ids)
        det = IncrementalDetokenizer(tok, [])
        for t in ids:
            det.update([t])
            assert FFFD not in det.output_text and expected.startswith(det.output_text)
        assert det.finish() == expected == det.output_text


def test_byte_fallback_tokenizers_really_fall_back() -> None:
    for name in ("byte_fallback_metaspace", "byte_fallback_strip"):
        tok = _get(name)
        assert len(_byte_ids(tok)) == 256
        tokens = tok.convert_ids_to_tokens(tok.encode("🦄 龍", add_special_tokens=False))
        assert sum(t.startswith("<0x") for t in tokens) >= 7
    assert not _byte_ids(_get("byte_level")) and not _byte_ids(_get("demo"))


def test_first_token_keeps_leading_space_after_prompt() -> None:
    for name in ("byte_fallback_metaspace", "byte_fallback_strip"):
        tok = _get(name)
        prompt = tok.encode("The quick", add_special_tokens=False)
        gen = tok.encode("brown fox", add_special_tokens=False)  # "▁brown": a Metaspace word start
        det = IncrementalDetokenizer(tok, prompt)
        det.update(gen)
        det.finish()
        assert det.output_text == " brown fox"
        assert tok.decode(gen) == "brown fox"  # without context the decoder drops that space


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_matches_transformers(tok: Any, spaces: bool) -> None:
    """transformers ignores the flag for fast tokenizers; the Rust path matches tokenizer.decode either way."""
    sp = _specials(tok)
    ids = tok.encode("Hello world", add_special_tokens=False) + [sp[-1], sp[0]] + tok.encode(" ok 😀")
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    for t in ids:
        det.update([t])
    det.finish()
    expected = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert det.uses_rust_decode and det.output_text == expected


def _stream(det: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, list[str]]:
    deltas, matched = [], None
    for t in ids:
        matched = det.update([t])
        deltas.append(det.get_delta())
        if matched is not None:
            break
    deltas.append(det.finish())
    return matched, deltas


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_split_across_tokens_and_inside_multibyte_characters(tok: Any, include: bool) -> None:
    text = "Emoji: 🦄🐉 and 龍虎 then Paris. more text after"
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    for stop in ["Paris.", "🐉", "龍", "虎 th", "🦄🐉 a", "s. mo"]:
        det = IncrementalDetokenizer(tok, [], stop=[stop, "never-matches"], include_stop_str_in_output=include)
        matched, deltas = _stream(det, ids)
        cut = full.index(stop) + (len(stop) if include else 0)
        assert matched == stop and det.stop_reason == stop
        assert det.output_text == full[:cut] == "".join(deltas)
        emitted = ""
        for d in deltas:  # the stream never shows a partial stop string or a U+FFFD
            emitted += d
            assert FFFD not in emitted and full[:cut].startswith(emitted)
            if not include:
                assert stop not in emitted


def test_stop_string_that_only_completes_with_a_multibyte_character(tok: Any) -> None:
    """'a🦄' must not match on 'a' + the first bytes of the emoji, nor on 'a🐉'."""
    ids = tok.encode("xa🐉 xa🦄 tail", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], stop=["a🦄"])
    matched, deltas = _stream(det, ids)
    assert matched == "a🦄" and det.output_text == "xa🐉 x" == "".join(deltas)


@pytest.mark.parametrize("name", ["byte_fallback_metaspace", "byte_fallback_strip"])
def test_long_byte_runs_stay_exact(name: str) -> None:
    """A run of 30+ byte tokens (rare CJK characters with no merges) is held back until it closes: cut mid-
    character at any point, the text so far is still a prefix of decode(), whose incomplete run is all U+FFFD."""
    tok = _get(name)
    rare = "鑫龘靐齉爩"  # not in the training corpus: every character falls back to 3 byte tokens
    ids = tok.encode(f"{rare}{rare} ok", add_special_tokens=False)
    byte_ids = set(_byte_ids(tok))
    run = 0
    for t in ids:
        run = run + 1 if t in byte_ids else 0
        if run > 16:
            break
    assert run > 16, "the test needs a long run of byte tokens"
    for cut in (len(ids), len(ids) - 3, 20, 17, 31):  # whole text, just before " ok", and mid-character cuts
        check_every_prefix(tok, [], ids[:cut], skip=True)


@pytest.mark.parametrize("skip", [True, False])
def test_deferred_equals_token_by_token_once_finished(tok: Any, skip: bool) -> None:
    """A final-only request's DeferredDetokenizer (all tokens at once, at the end) gives exactly the finished text
    of the incremental detokenizer fed one token at a time, cut at awkward lengths (inside byte runs and
    multi-byte characters), with spaces_between_special_tokens on and off."""
    for n, (prompt, gen) in enumerate(_sequences(tok, seed=11 + int(skip), n=30)):
        spaces = n % 2 == 0
        for end in sorted({1, len(gen) // 3, len(gen) - 1, len(gen)} - {0}):
            step = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            deferred = DeferredDetokenizer(tok, prompt, skip_special_tokens=skip,
                                           spaces_between_special_tokens=spaces)
            for t in gen[:end]:
                step.update([t])
                deferred.update([t])
            assert deferred.output_text == ""  # not read before the end
            step.finish()
            deferred.finish()
            assert deferred.output_text == step.output_text, (prompt, gen[:end])
