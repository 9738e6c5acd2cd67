"""Tensor-parallel benchmark (issue 18): a Qwen3-8B-shaped random bf16 model at TP=1 and TP=2.

Per TP size (each in a fresh child process): start-up time, L1 batch-1 TTFT/TPOT, optional T1 output tok/s,
and greedy tokens with their top-5 logprobs. Then HF (one GPU) checks the greedy tokens: equal, or at the first
divergence each side's token is in the other's top-5. Prints (and writes) JSON with the bandwidth floor of a
batch-1 decode per TP size. The model is written straight from random GPU tensors (no HF init; ~1 min for 8B).

    python tools/bench_tp.py --out /tmp/qwen3-8b-random --tp-sizes 1,2
    python tools/bench_tp.py --tp-sizes 1; python tools/bench_tp.py --tp-sizes 1,2 --reuse   # over 2 calls
    python tools/bench_tp.py --layers 2 --hidden 256 --intermediate 512 --heads 4 --kv-heads 2 --vocab 1000 \\
        --device cpu --out /tmp/tiny-tp    # CPU smoke test (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import PROMPT_VOCAB, env_info, measure_ttft_tpot, random_prompts, resolve_device

DEFAULT_OUT = "/tmp/qwen3-8b-random"
SHARD_BYTES = 4 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="model directory (built when missing or of another shape)")
    # Qwen3-8B's shape by default
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tie", action="store_true", help="tied embeddings (Qwen3-8B has an untied lm_head)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="cuda (NCCL) or cpu (gloo); auto = cuda when available")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--prompt-len", type=int, default=128, help="L1 prompt length")
    p.add_argument("--output-len", type=int, default=128, help="L1 tokens per request (TPOT over N - 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check-prompts", type=int, default=4, help="prompts for the greedy HF check (0 = skip it)")
    p.add_argument("--check-tokens", type=int, default=48)
    p.add_argument("--t1-requests", type=int, default=0,
                   help="T1 throughput: this many requests (BENCHMARKS.md uses 256), prompts 100-1024, "
                        "--t1-output-len tokens each, T=0.6; 0 = skip")
    p.add_argument("--t1-output-len", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8, help="raise to 256 with --t1-requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="off by default: the L1 runs repeat one prompt, and TTFT should time its prefill")
    p.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth per GPU for the floor (H200: 4.8)")
    p.add_argument("--json", default="bench_tp.json", help="where to write the report")
    p.add_argument("--reuse", action="store_true",
                   help="take a TP size's results from an earlier run's bench_tp.tpN.json when there is one (to split "
                        "the work over several calls: --tp-sizes 1, then --tp-sizes 1,2 --reuse)")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # internal: run one TP size
    p.add_argument("--child-json", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the model ----------------------------------------------------------------------------------------

def _hf_config(args: argparse.Namespace) -> Any:
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=args.tie, max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu",
        attention_bias=False, use_sliding_window=False, bos_token_id=0, eos_token_id=1)
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = torch.bfloat16
    return cfg


def _weight_shapes(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    h, d, i = args.hidden, args.head_dim, args.intermediate
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (args.vocab, h))]
    for n in range(args.layers):
        p = f"model.layers.{n}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (args.heads * d, h)),
                   (p + "self_attn.k_proj.weight", (args.kv_heads * d, h)),
                   (p + "self_attn.v_proj.weight", (args.kv_heads * d, h)),
                   (p + "self_attn.o_proj.weight", (h, args.heads * d)),
                   (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                   (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                   (p + "mlp.down_proj.weight", (h, i))]
    shapes.append(("model.norm.weight", (h,)))
    if not args.tie:
        shapes.append(("lm_head.weight", (args.vocab, h)))
    return shapes


def build_model(args: argparse.Namespace, device: torch.device) -> Path:
    """Random bf16 weights (normal(0, 0.02) like HF's init, norms 1) straight to sharded safetensors."""
    from safetensors.torch import save_file

    out = Path(args.out)
    cfg = _hf_config(args)
    marker = out / "bench_tp_shape.json"
    shape = {k: v for k, v in vars(args).items() if k in ("vocab", "hidden", "intermediate", "layers", "heads",
                                                          "kv_heads", "head_dim", "tie", "seed")}
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shp in _weight_shapes(args):
        if len(shp) == 1:
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = torch.empty(shp, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen).cpu()
        if size + t.numel() * 2 > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * 2 for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    cfg.save_pretrained(out)
    marker.write_text(json.dumps(shape))
    print(f"built {total / 2**30:.1f} GiB of bf16 weights in {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def decode_bytes_per_rank(args: argparse.Namespace, tp: int) -> int:
    """Weight bytes one rank reads per batch-1 decode step: its share of every matrix (KV projections replicated
    when there are fewer KV heads than ranks) and of the LM head; of the embedding table only one row (ignored)."""
    h, d = args.hidden, args.head_dim
    kv_local = max(args.kv_heads // tp, 1)
    layer = (2 * args.heads * d * h + 3 * h * args.intermediate) // tp + 2 * kv_local * d * h
    return 2 * (args.layers * layer + args.vocab * h // tp)


# ---- one TP size (child process) --------------------------------------------------------------------

def run_child(args: argparse.Namespace) -> None:
    from graphrunner import LLM, SamplingParams

    device = resolve_device(args.device)
    t0 = time.perf_counter()
    llm = LLM(model=args.out, tensor_parallel_size=args.child, device=str(device), max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              skip_tokenizer_init=True, seed=args.seed, enable_prefix_caching=args.enable_prefix_caching)
    result: dict[str, Any] = {"tp": args.child, "startup_s": time.perf_counter() - t0}
    if args.check_prompts:
        params = SamplingParams(temperature=0.0, max_tokens=args.check_tokens, ignore_eos=True, logprobs=5,
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in check_prompts(args)], params, use_tqdm=False)
        result["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
        result["top5"] = [[[t for t in lp if lp[t].rank <= 5] for lp in o.outputs[0].logprobs] for o in outs]
    prompt = random_prompts(1, args.prompt_len, args.prompt_len, seed=1, vocab=prompt_vocab(args))[0]

    def run(n: int) -> None:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                                     detokenize=False), use_tqdm=False)

    lat = measure_ttft_tpot(run, args.output_len, args.repeats, device)
    result.update(ttft_ms=lat["ttft_ms"], tpot_ms=lat["tpot_ms"])
    if args.t1_requests:
        prompts = random_prompts(args.t1_requests, 100, 1024, seed=0, vocab=prompt_vocab(args))
        params = SamplingParams(temperature=0.6, max_tokens=args.t1_output_len, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        took = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(t1_tok_s=tokens / took, t1_tokens=tokens, t1_s=took)
    llm.engine.shutdown()
    Path(args.child_json).write_text(json.dumps(result))


def prompt_vocab(args: argparse.Namespace) -> int:
    return min(args.vocab, PROMPT_VOCAB)


def check_prompts(args: argparse.Namespace) -> list[list[int]]:
    return random_prompts(args.check_prompts, 16, 128, seed=2, vocab=prompt_vocab(args))


# ---- HF check -----------------------------------------------------------------------------------------

def hf_check(args: argparse.Namespace, runs: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Per TP size and prompt: tokens equal HF greedy, or at the first divergence each side's token is in the
    other's top-5 (HF's top-5 from a forward over the shared prefix; ours from the engine's logprobs)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    report: dict[str, Any] = {}
    with torch.no_grad():
        refs = []
        for p in check_prompts(args):
            out = hf.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.int64,
                              device=device), do_sample=False, max_new_tokens=args.check_tokens, eos_token_id=None,
                              pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
        for run in runs:
            cases = []
            for p, ref, mine, top5 in zip(check_prompts(args), refs, run["greedy"], run["top5"], strict=True):
                k = next((j for j, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), None)
                if k is None:
                    cases.append({"equal": True})
                    continue
                logits = hf(torch.tensor([p + ref[:k]], device=device)).logits[0, -1].float()
                hf_top5 = logits.topk(5).indices.tolist()
                cases.append({"equal": False, "diverge_at": k, "ours_in_hf_top5": mine[k] in hf_top5,
                              "hf_in_ours_top5": ref[k] in top5[k]})
            ok = all(c["equal"] or (c["ours_in_hf_top5"] and c["hf_in_ours_top5"]) for c in cases)
            report[f"tp{run['tp']}"] = {"pass": ok, "cases": cases}
        # TP=2 against TP=1 directly
        by_tp = {run["tp"]: run for run in runs}
        if 1 in by_tp:
            for tp, run in by_tp.items():
                if tp != 1:
                    report[f"tp{tp}_equals_tp1"] = run["greedy"] == by_tp[1]["greedy"]
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        run_child(args)
        return {}
    device = resolve_device(args.device)
    build_model(args, device)
    runs = []
    for tp in [int(x) for x in args.tp_sizes.split(",") if x.strip()]:
        child_json = Path(args.json).with_suffix(f".tp{tp}.json")
        if args.reuse and child_json.is_file():
            runs.append(json.loads(child_json.read_text()) | {"reused": str(child_json)})
            continue
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", str(tp),
               "--child-json", str(child_json)]
        print(f"TP={tp}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, check=False, env=os.environ.copy())
        if done.returncode != 0:
            runs.append({"tp": tp, "error": f"child exited with {done.returncode} after "
                                            f"{time.perf_counter() - t0:.0f} s"})
            continue
        runs.append(json.loads(child_json.read_text()))
    good = [r for r in runs if "error" not in r]
    report: dict[str, Any] = {"env": env_info(), "model": vars(args) | {"child": None}, "runs": [],
                              "tp_sample": os.environ.get("GRAPHRUNNER_TP_SAMPLE", "shard"),
                              "tp_all_reduce": os.environ.get("GRAPHRUNNER_TP_ALLREDUCE", "nccl")}
    for r in runs:
        floor = decode_bytes_per_rank(args, r["tp"]) / (args.hbm_tb_s * 1e12) * 1e3
        report["runs"].append({k: v for k, v in r.items() if k not in ("greedy", "top5")}
                              | {"tpot_floor_ms": floor})
    tpot = {r["tp"]: r["tpot_ms"] for r in good}
    if 1 in tpot:
        report["tpot_speedup_vs_tp1"] = {f"tp{tp}": tpot[1] / t for tp, t in tpot.items() if tp != 1}
    checked = [r for r in good if "greedy" in r]
    if args.check_prompts and checked:
        report["greedy_check"] = hf_check(args, checked, device)
    text = json.dumps(report, indent=1, default=str)
    Path(args.json).write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
