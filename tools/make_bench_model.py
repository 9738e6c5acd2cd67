"""Build the random-weight Qwen3-0.6B-shaped benchmark model of BENCHMARKS.md (bf16, save_pretrained).

Defaults give the real benchmark shape; --layers/--hidden/... shrink it for CPU smoke tests. No tokenizer is
written: the benchmarks feed token ids. Example: python tools/make_bench_model.py --out /tmp/qwen3-0.6b-random
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
