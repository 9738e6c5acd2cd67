"""SV1 of BENCHMARKS.md: `graphrunner serve` over HTTP (streaming) against the offline engine.

Starts `python -m graphrunner serve` on 127.0.0.1, waits for /health, then with tools/bench_serve.py:
  * concurrency 1: L1's shape (128-token prompt, 256 greedy tokens, ignore EOS): TTFT and TPOT p50/p99;
  * concurrency 256: T1's shape (256 requests, prompts of 100-1024 tokens, 512 tokens at T=0.6): output tok/s;
and reads the server's engine-loop counters from /metrics (time per step inside engine.step(), delivering
outputs, between steps). Offline figures to compare with come from the JSON of bench_latency.py and
bench_throughput.py (--offline-l1 / --offline-t1). The server is stopped with SIGTERM and must exit 0.
Example: python tools/bench_sv1.py --model /tmp/q06 --offline-l1 l1.json --offline-t1 t1.json --json sv1.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
from bench_http import resolve_client, scrape_metrics
from bench_serve import random_token_prompts, run_load

HOST = "127.0.0.1"
LOOP = ("graphrunner:engine_loop_steps_total", "graphrunner:engine_loop_step_seconds_total",
        "graphrunner:engine_loop_wait_seconds_total",
        "graphrunner:engine_loop_deliver_seconds_total", "graphrunner:engine_loop_between_steps_seconds_total")


def start_server(args: argparse.Namespace, log: Any) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "graphrunner", "serve", "--model", args.model, "--host", HOST, "--port",
           str(args.port), "--max-num-seqs", "256", "--max-model-len", "1600",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--engine-process" if args.engine_process else "--no-engine-process"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # run the tree this tool sits in
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{base}/health", timeout=2.0, trust_env=False).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s} s")


def loop_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k.split("engine_loop_")[1]: after.get(k, 0.0) - before.get(k, 0.0) for k in LOOP}
    steps = max(1.0, d["steps_total"])
    return {"steps": d["steps_total"], "step_ms": d["step_seconds_total"] / steps * 1e3,
            "wait_ms": d["wait_seconds_total"] / steps * 1e3,
            "deliver_ms": d["deliver_seconds_total"] / steps * 1e3,
            "between_ms": d["between_steps_seconds_total"] / steps * 1e3}


def engine_ttft_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean of the engine's vllm:time_to_first_token_seconds over the requests between two scrapes."""
    name = "vllm:time_to_first_token_seconds"
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return total / count * 1e3 if count else float("nan")


async def measure(base: str, model_name: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    l1_body = {"ignore_eos": True, "temperature": 0.0}
    l1 = random_token_prompts(args.l1_requests + 2, 128, 128, seed=1)
    clients = list(dict.fromkeys(resolve_client(c) for c in args.clients.split(",")))
    for client in clients:  # TTFT includes the client's own time: one c=1 run per client library
        await run_load(base, model_name, l1[:2], num_requests=2, max_tokens=args.l1_tokens, concurrency=1,
                       extra_body=l1_body, client=client)  # warm-up
        before = await scrape_metrics(base)
        r = await run_load(base, model_name, l1[2:], num_requests=args.l1_requests, max_tokens=args.l1_tokens,
                           concurrency=1, extra_body=l1_body, client=client)
        after = await scrape_metrics(base)
        key = "c1" if client == clients[0] else f"c1_{client}"
        out[key] = r.to_dict()
        out[f"{key}_engine_ttft_ms"] = engine_ttft_ms(before, after)
        print(f"concurrency 1 (L1 shape), {client} client:\n" + r.table(), flush=True)
        print(f"engine-side TTFT (arrival in the engine to its first token on the host), mean: "
              f"{out[f'{key}_engine_ttft_ms']:.2f} ms; the rest of the client's TTFT is HTTP, the front and the pipe",
              flush=True)
    t1_body = {"ignore_eos": True, "temperature": 0.6}
    t1 = random_token_prompts(args.t1_requests, 100, 1024, seed=0)
    await run_load(base, model_name, t1[:8], num_requests=8, max_tokens=16, concurrency=8, extra_body=t1_body,
                   client=clients[0])
    before = await scrape_metrics(base)
    r = await run_load(base, model_name, t1, num_requests=args.t1_requests, max_tokens=args.t1_tokens,
                       concurrency=args.t1_requests, extra_body=t1_body, timeout_s=600.0, client=clients[0])
    after = await scrape_metrics(base)
    out["c256"] = r.to_dict()
    out["c256_loop"] = loop_delta(before, after)
    print(f"concurrency {args.t1_requests} (T1 shape):\n" + r.table(), flush=True)
    print(f"engine loop during it: {out['c256_loop']}", flush=True)
    return out


def offline(path: str | None, key: str) -> float | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    for row in data.get("rows", []):
        if row.get("workload") == key[0] and key[1] in row.get("metric", ""):
            return row.get("ours")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--l1-requests", type=int, default=10)
    p.add_argument("--clients", default="auto,httpx",
                   help="c=1 is measured once per client library listed (auto: aiohttp when installed); c=256 "
                        "uses the first")
    p.add_argument("--l1-tokens", type=int, default=256)
    p.add_argument("--t1-requests", type=int, default=256)
    p.add_argument("--t1-tokens", type=int, default=512)
    p.add_argument("--offline-l1", default=None, help="bench_latency.py JSON (L1 TPOT/TTFT rows)")
    p.add_argument("--offline-t1", default=None, help="bench_throughput.py JSON (T1 row)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's engine loop in its own process (its default) or in a thread")
    p.add_argument("--log", default="serve.log")
    p.add_argument("--json", default="bench_sv1.json")
    args = p.parse_args(argv)
    base = f"http://{HOST}:{args.port}"
    with open(args.log, "w") as log:
        proc = start_server(args, log)
        try:
            startup = wait_healthy(base, proc, 600.0)
            print(f"server healthy after {startup:.1f} s", flush=True)
            model_name = httpx.get(f"{base}/v1/models", trust_env=False).json()["data"][0]["id"]
            result = asyncio.run(measure(base, model_name, args))
            result["startup_s"] = startup
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = -9
    result["server_exit_code"] = rc
    result["engine_process"] = args.engine_process
    c1, c256 = result["c1"], result["c256"]
    result["offline"] = {"l1_tpot_ms": offline(args.offline_l1, ("L1", "TPOT")),
                         "l1_ttft_ms": offline(args.offline_l1, ("L1", "TTFT")),
                         "t1_tok_s": offline(args.offline_t1, ("T1", "throughput"))}
    off = result["offline"]
    print(f"HTTP c=1: TPOT p50 {c1['tpot_ms']['p50']:.3f} ms (offline L1 {off['l1_tpot_ms']}), TTFT p50 "
          f"{c1['ttft_ms']['p50']:.2f} ms (offline {off['l1_ttft_ms']}); c=256: {c256['output_throughput']:.0f} tok/s "
          f"(offline T1 {off['t1_tok_s']}); server exit code {rc}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
