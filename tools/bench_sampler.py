"""Sampler micro-benchmark: batch 1/64/256 x vocab 151936, ours vs a plain PyTorch path.

Ours is `graphrunner.sampling.sampler.run_sampler` (Triton on CUDA) for several settings; the
peer is softmax + torch.multinomial (with sort-based top-k/top-p where the setting asks for it).
`--rejection` instead times the verify step's two rejection kernels (one program per request walking its rows;
the vocabulary split across programs) at k drafts per request, every draft accepted or the first one rejected.
Prints a table and writes JSON. Example: python tools/bench_sampler.py --json bench_sampler.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_common import median_ms

from graphrunner.sampling.batch import RequestSampling, SampleEntry, build_sampling_batch
from graphrunner.sampling.rejection import rejection_sample_triton
from graphrunner.sampling.rejection_split import rejection_sample_split_triton
from graphrunner.sampling.sampler import run_sampler
from graphrunner.sampling_params import SamplingParams
from graphrunner.state_table import StateTable

SETTINGS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-k/top-p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "penalties": {"temperature": 0.8, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "logprobs=5": {"temperature": 0.8, "logprobs": 5},
}


def _peer(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.temperature == 0:
        return logits.argmax(-1)
    x = logits / p.temperature
    if p.top_k > 0 or p.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        if p.top_k > 0:
            sorted_x[:, p.top_k:] = float("-inf")
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.multinomial(x.softmax(-1), 1)[:, 0]


def run(batch_sizes: list[int], vocab: int, iters: int, device: torch.device, use_triton: bool) -> list[dict]:
    rows = []
    history = 512
    state = StateTable(max(batch_sizes), history + 1, 4, device, use_triton, vocab)
    for bs in batch_sizes:
        logits = torch.randn(bs, vocab, device=device) * 3
        for name, kw in SETTINGS.items():
            params = SamplingParams(max_tokens=1, seed=1, **kw)
            for r in range(bs):
                state.stage_new_row(r, [(r * 7 + i) % vocab for i in range(history)], history // 2, 0, params, r)
            state.apply_staged()
            idx = torch.arange(bs, dtype=torch.int32, device=device)
            entries = [SampleEntry(r, params, RequestSampling(), 0) for r in range(bs)]
            sbatch = build_sampling_batch(entries, idx, device)
            ours = median_ms(lambda x=logits, b=sbatch: run_sampler(x.clone(), b, state, use_triton), device, iters)
            peer = median_ms(lambda x=logits, p=params: _peer(x.clone(), p), device, iters)
            rows.append({"batch": bs, "vocab": vocab, "setting": name, "ours_ms": ours, "peer_ms": peer,
                         "speedup": peer / ours})
            print(f"  b={bs:<4} {name:<12} ours {ours:8.3f} ms   torch {peer:8.3f} ms   {peer / ours:5.2f}x",
                  flush=True)
    return rows


def run_rejection(batch_sizes: list[int], vocab: int, k: int, iters: int, device: torch.device) -> list[dict]:
    """The walk kernel vs the split kernel per (batch, greedy or sampled, drafts all accepted or first rejected)."""
    rows = []
    for bs in batch_sizes:
        logits = torch.randn(bs * (k + 1), vocab, device=device) * 3  # [B * (k + 1), V] float32
        # one dominant entry per row, so a sampled request accepts its matching drafts with probability ~1
        target = torch.randint(0, vocab, (bs * (k + 1),), device=device)  # [B * (k + 1)] int64
        logits[torch.arange(bs * (k + 1), device=device), target] = 60.0
        cu = torch.arange(0, bs * (k + 1) + 1, k + 1, dtype=torch.int32, device=device)  # [B + 1] int32
        num_drafts = torch.full((bs,), k, dtype=torch.int32, device=device)  # [B] int32
        seeds = torch.arange(bs, dtype=torch.int64, device=device)  # [B] int64
        positions = torch.full((bs,), 300, dtype=torch.int64, device=device)  # [B] int64
        accepted = target.view(bs, k + 1)[:, :k].int().contiguous()  # [B, k] int32: every draft is the target's
        for temp in (0.0, 0.8):
            temperature = torch.full((bs,), temp, device=device)  # [B] float32
            for case, drafts in (("all accepted", accepted), ("first rejected", (accepted + 1) % vocab)):
                args = (logits, cu, drafts, num_drafts, None, temperature, seeds, positions)
                walk = median_ms(lambda a=args: rejection_sample_triton(*a), device, iters)
                split = median_ms(lambda a=args: rejection_sample_split_triton(*a[:4], *a[5:]), device, iters)
                name = f"{'greedy' if temp == 0 else 'T=0.8'}, {case}"
                rows.append({"batch": bs, "vocab": vocab, "k": k, "setting": name, "walk_ms": walk,
                             "split_ms": split})
                print(f"  b={bs:<4} k={k} {name:<24} walk {walk * 1e3:8.1f} us   split {split * 1e3:8.1f} us",
                      flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="bench_sampler.json")
    ap.add_argument("--rejection", action="store_true", help="time the rejection kernels instead (see above)")
    ap.add_argument("--k", type=int, default=4, help="--rejection: drafts per request")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.rejection:
        rows = run_rejection([int(b) for b in args.batch_sizes.split(",")], args.vocab, args.k, args.iters, device)
        with open(args.json, "w") as f:
            json.dump({"script": "bench_sampler --rejection", "args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
        return
    print(f"device {device}; peer = softmax + torch.multinomial (sort-based top-k/top-p); ours includes the "
          f"logits clone both sides pay")
    rows = run([int(b) for b in args.batch_sizes.split(",")], args.vocab, args.iters, device, device.type == "cuda")
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    with open(args.json, "w") as f:
        json.dump({"script": "bench_sampler", "env": env, "args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
