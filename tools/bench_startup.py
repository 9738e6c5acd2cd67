"""Workload S1: process start to first generated token, in fresh processes.

* eager: no compilation at all;
* cold: `graphrunner precompile` into an empty directory (compiles every piece from scratch), then
  a run from it — the cold figure is both together, as a first-ever deployment would pay;
* warm: a run from the already precompiled directory (compiled code loaded from the caches).
Prints a table and writes JSON. Example: python tools/bench_startup.py --model /tmp/q06 --json s1.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_TOKEN = """
import sys, time
t0 = float(sys.argv[1])
from graphrunner import LLM, SamplingParams
kw = {} if sys.argv[3] == "-" else {"compile_cache": sys.argv[3]}
llm = LLM(model=None if sys.argv[2] == "-" else sys.argv[2], **kw)
llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
print(f"FIRST_TOKEN {time.time() - t0:.3f}")
"""


def _first_token(model: str, cache: str) -> float:
    """Seconds from spawning a Python process to its first generated token."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(t0), model, cache], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed: {proc.stderr[-2000:]}")
    return float(proc.stdout.split("FIRST_TOKEN")[-1])


def _precompile(model: str, out: Path) -> float:
    t0 = time.time()
    cmd = [sys.executable, "-m", "graphrunner", "precompile", "--out", str(out)]
    if model != "-":
        cmd += ["--model", model]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"precompile failed: {proc.stderr[-2000:]}")
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="-", help="model directory (default: the shipped demo model)")
    ap.add_argument("--json", default="bench_startup.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cc"
        eager = _first_token(args.model, "-")
        precompile_s = _precompile(args.model, cache)
        warm = _first_token(args.model, str(cache))
    rows = {"eager_first_token_s": eager, "cold_precompile_s": precompile_s,
            "cold_total_s": precompile_s + warm, "warm_first_token_s": warm}
    for name, value in rows.items():
        print(f"  {name:<22} {value:8.2f} s")
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": sys.version.split()[0]}
    with open(args.json, "w") as f:
        json.dump({"script": "bench_startup", "env": env, "args": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
