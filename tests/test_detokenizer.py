"""Tests for graphrunner.detokenizer: incremental decoding equals a full decode, stop strings, streaming deltas.

Uses a small byte-level BPE tokenizer trained inline (English + é, 中文, emoji) so that multi-byte characters
are split across byte tokens; nothing is downloaded.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from graphrunner.detokenizer import IncrementalDetokenizer

EOT = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs away.",
    "Large language models generate text one token at a time; an inference engine must stream that text.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "In the beginning there was nothing, and then there were tokens, and the tokens were decoded into words.",
    "Café, naïve, résumé, déjà vu: accents are common in borrowed words. Été à la plage, très élégant.",
    "中文文本也需要正确地解码。我们喜欢测试中文字符。",
    "Emoji time: 😀 🎉 👍🏽 🚀 and a family 👨‍👩‍👧 plus a flag 🇫🇷.",
]
# Strings encoded for the tests; several contain characters absent from the training text.
SAMPLES = CORPUS + [
    "Hello world! The capital of Spain is Madrid.",
    "Unseen emoji: 🦄🐉🧠 and CJK 龍虎 and accents ÅØÆ ñ ü.",
    "mixed 😀é中 text 🎉🎉🎉 end",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, clean_up_tokenization_spaces=False)


def _eot(tokenizer: PreTrainedTokenizerFast) -> int:
    return tokenizer.convert_tokens_to_ids(EOT)


def _run(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[str | None, str]:
    """Feeds ids in chunks, collecting streaming deltas; returns (stop string, concatenated deltas)."""
    stream, matched = [], None
    for i in range(0, len(ids), chunk):
        matched = det.update(ids[i : i + chunk])
        stream.append(det.get_delta())
        if matched is not None:
            break
    stream.append(det.finish())
    return matched, "".join(stream)


def _random_sequences(tokenizer: PreTrainedTokenizerFast, n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt, generated) pairs cut from encodings of real strings at arbitrary token positions."""
    rng = random.Random(seed)
    encoded = [tokenizer.encode(s) for s in SAMPLES]
    eot = _eot(tokenizer)
    out = []
    for _ in range(n):
        a, b = rng.sample(encoded, 2)
        ids = a + ([eot] if rng.random() < 0.3 else []) + b
        start = rng.randrange(0, len(ids))
        stop = rng.randrange(start, len(ids) + 1)
        prompt = ids[: rng.randrange(0, start + 1)] if rng.random() < 0.5 else []
        # Prompts end at a character boundary, as real prompts do; the generated part may start/end anywhere.
        if tokenizer.decode(prompt).endswith("\ufffd"):
            prompt = []
        out.append((prompt, ids[start:stop]))
    return out


def test_emoji_is_split_across_byte_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("🦄")
    assert len(ids) > 1
    assert "\ufffd" in tokenizer.decode(ids[:1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_one_token_at_a_time_matches_full_decode(tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool) -> None:
    for prompt, gen in _random_sequences(tokenizer, 300):
        det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        texts = []
        for t in gen:
            det.update([t])
            texts.append(det.output_text)
            assert "\ufffd" not in det.output_text or "\ufffd" in tokenizer.decode(gen)
        det.finish()
        expected = tokenizer.decode(gen, skip_special_tokens=skip_special_tokens)
        assert det.output_text == expected
        for t in texts:  # text only ever grows
            assert expected.startswith(t)


def test_no_replacement_char_mid_text_for_valid_utf8(tokenizer: PreTrainedTokenizerFast) -> None:
    for s in SAMPLES:
        ids = tokenizer.encode(s)
        det = IncrementalDetokenizer(tokenizer, [])
        for t in ids:
            det.update([t])
            assert "\ufffd" not in det.output_text
            assert s.startswith(det.output_text)
        assert det.output_text == s


def test_random_ids_and_chunked_updates(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(1)
    vocab = len(tokenizer)
    for trial in range(200):
        gen = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        det = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=trial % 2 == 0)
        _run(det, gen, chunk=1 + trial % 4)
        assert det.output_text == tokenizer.decode(gen, skip_special_tokens=trial % 2 == 0)


def test_decode_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    calls: list[int] = []
    original = tokenizer.decode

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(tokenizer, name)

        def decode(self, ids: list[int], **kwargs: object) -> str:
            calls.append(len(ids))
            return original(ids, **kwargs)

    ids = tokenizer.encode(" ".join(SAMPLES * 4))
    det = IncrementalDetokenizer(Spy(), ids[:50])
    for t in ids:
        det.update([t])
    assert max(calls) <= 2 + 2 * 4  # window: previous step's tokens + pending partial character
    assert len(calls) <= 6 * len(ids)


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The capital of France is Paris. Berlin is the capital of Germany."
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, [], stop=["Paris."])
    matched, stream = _run(det, ids)
    assert matched == "Paris."
    assert det.stop_reason == "Paris."
    assert det.output_text == "The capital of France is "
    assert stream == det.output_text
    assert det.update(tokenizer.encode(" more")) is None  # finished: later tokens are ignored
    assert det.output_text == "The capital of France is "


def test_stop_string_at_very_start(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("The dog sleeps")
    det = IncrementalDetokenizer(tokenizer, [], stop=["The"])
    matched, stream = _run(det, ids)
    assert matched == "The"
    assert det.output_text == "" and stream == ""
    det = IncrementalDetokenizer(tokenizer, [], stop=["The"], include_stop_str_in_output=True)
    matched, stream = _run(det, ids)
    assert matched == "The" and det.output_text == "The" and stream == "The"


def test_stop_string_matched_in_final_token(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Rome is the capital of Italy."
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, [], stop=["Italy."])
    for i, t in enumerate(ids):
        matched = det.update([t])
        assert (matched is not None) == (i == len(ids) - 1)
    assert det.output_text == "Rome is the capital of "
    assert det.finish() == "Rome is the capital of "


def test_include_stop_str_in_output_drops_text_after_it(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("abc the dog. then more text follows")
    det = IncrementalDetokenizer(tokenizer, [], stop=["dog. th"], include_stop_str_in_output=True)
    matched, stream = _run(det, ids, chunk=len(ids))  # everything in one update
    assert matched == "dog. th"
    assert det.output_text == "abc the dog. th" == stream


def test_several_stop_strings_earliest_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Paris is the capital of France. Berlin is the capital of Germany."
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, [], stop=["Germany", "capital", "France"])
    matched, _ = _run(det, ids, chunk=len(ids))
    assert matched == "capital"
    assert det.output_text == "Paris is the "
    # Token by token: "France" completes before "Germany"; "capital" appears first of all.
    det = IncrementalDetokenizer(tokenizer, [], stop=["Germany", "France"])
    matched, stream = _run(det, ids)
    assert matched == "France" and det.output_text == "Paris is the capital of " == stream


def test_stop_string_with_non_ascii(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "mixed 😀é中 text 🎉🎉🎉 end"
    det = IncrementalDetokenizer(tokenizer, [], stop=["é中"])
    matched, stream = _run(det, tokenizer.encode(text))
    assert matched == "é中" and det.output_text == "mixed 😀" == stream


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_deltas_concatenate_to_final_text(tokenizer: PreTrainedTokenizerFast, chunk: int) -> None:
    rng = random.Random(chunk)
    for prompt, gen in _random_sequences(tokenizer, 100, seed=chunk):
        words = tokenizer.decode(gen, skip_special_tokens=True).split()
        stop = [rng.choice(words)[:4]] if words and rng.random() < 0.5 else None
        det = IncrementalDetokenizer(tokenizer, prompt, stop=(stop or []) + ["zzz_never"])
        stream = []
        for i in range(0, len(gen), chunk):
            matched = det.update(gen[i : i + chunk])
            delta = det.get_delta()
            stream.append(delta)
            if not det.finished:  # held back: a stop string could still start in the last len-1 chars
                assert len("".join(stream)) <= max(0, len(det.output_text) - (len("zzz_never") - 1))
            if matched is not None:
                break
        stream.append(det.finish())
        assert "".join(stream) == det.output_text
        assert det.get_delta() == ""
        full = tokenizer.decode(gen, skip_special_tokens=True)
        if det.stop_reason is None:
            assert det.output_text == full
        else:
            assert det.output_text == full[: full.index(det.stop_reason)]
