"""Build the random-weight Qwen3-0.6B-shaped benchmark model of BENCHMARKS.md (bf16, save_pretrained).

Defaults give the real benchmark shape; --layers/--hidden/... shrink it for CPU smoke tests. The benchmarks feed
token ids; --tokenizer also writes a synthetic byte-level BPE tokenizer over the whole vocabulary (word-like
pieces, most with a leading space), so that detokenization and the server's text costs are real. Example:
python tools/make_bench_model.py --out /tmp/qwen3-0.6b-random --tokenizer
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

DEFAULT_OUT = "/tmp/qwen3-0.6b-random"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default %(default)s)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--max-position-embeddings", type=int, default=40960)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto",
                   help="where weights are initialised; auto = cuda when available (much faster; the values differ "
                        "from a CPU build, speed does not); default %(default)s")
    p.add_argument("--tokenizer", action="store_true", help="also write a synthetic tokenizer (see the docstring)")
    p.add_argument("--force", action="store_true", help="rebuild even if --out already holds a model")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=True,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
    )


def build_model(config: transformers.Qwen3Config, dtype: torch.dtype, seed: int, device: str) -> torch.nn.Module:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(dtype).eval()


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids: the 256 byte symbols, then distinct word-like
    pieces (3/4 with a leading space, a few multi-byte ones), the last id "<|endoftext|>". No merges: encoding
    falls back to bytes, which is all a benchmark that sends token ids needs; decoding covers every id."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    symbol = _bytes_to_unicode()
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(symbol)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        if rng.random() < 0.02:
            word += "é"  # a two-byte character inside a piece
        text = (" " if rng.random() < 0.75 else "") + word
        vocab.setdefault("".join(symbol[b] for b in text.encode()), len(vocab))
    vocab["<|endoftext|>"] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (byte b is symbol [b])."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def already_built(out: Path, config: transformers.Qwen3Config) -> bool:
    """True when `out` holds weights saved from the same config (so repeated benchmark runs skip the build)."""
    cfg_path = out / "config.json"
    if not cfg_path.is_file() or not any(out.glob("*.safetensors")):
        return False
    saved = json.loads(cfg_path.read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings")
    return all(saved.get(k) == getattr(config, k) for k in keys)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = Path(args.out)
    config = build_config(args)
    if args.tokenizer and (args.force or not (out / "tokenizer.json").is_file()):
        tok = synthetic_tokenizer(args.vocab, args.seed)
        tok.save_pretrained(out)
        print(f"wrote a synthetic {len(tok)}-id tokenizer to {out}")
    if not args.force and already_built(out, config):
        print(f"{out} already holds this model (use --force to rebuild)")
        return out
    t0 = time.perf_counter()
    model = build_model(config, DTYPES[args.dtype], args.seed, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    print(f"saved {n_params / 1e6:.1f}M parameters ({args.dtype}) to {out} in {time.perf_counter() - t0:.1f} s")
    return out


if __name__ == "__main__":
    main()
