"""Workload S1: process start to first generated token, in fresh processes.

* eager: `enforce_eager=True`, no compilation and no CUDA graphs (for reference);
* cold: the default engine (compile + graphs) with Inductor's and Triton's caches pointed at empty
  directories, so every piece compiles from scratch, as a first-ever deployment without
  precompiled artifacts pays;
* precompile: `graphrunner precompile` into an empty directory (offline, once);
* warm: a run from that precompiled directory (the saved split graph loaded, capture/saved_graph.py);
* warm-traced: the same with GRAPHRUNNER_AOT=0 (Dynamo traces the model again; with Inductor pieces its cache serves them);
* cold-uncompiled, precompile-uncompiled, warm-uncompiled: the same for the uncompiled engine with FULL graphs
  (`compilation_config={"level": 0, "cudagraph_mode": "FULL"}`: no Dynamo, no Inductor; its precompiled directory
  holds the Triton kernels);
* cold-eager-pieces, precompile-eager-pieces, warm-eager-pieces: the same for the compiled engine with eager pieces
  (`compilation_config={"backend": "eager"}`: the default graphs, no Inductor; a warm start loads the saved split
  graph without Dynamo, capture/saved_graph.py).
Each run also says whether the process imported torch._dynamo.
Prints a table and writes JSON. Example: python tools/bench_startup.py --model /tmp/q06 --json s1.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

FIRST_TOKEN = """
import json, os, sys, time
t0 = float(sys.argv[1])
from graphrunner import LLM, SamplingParams
print(f"STAGE imported {time.time() - t0:.3f}", flush=True)
kw = {"enforce_eager": True} if sys.argv[3] == "eager" else {}
if sys.argv[3] not in ("eager", "-"):
    kw["compile_cache"] = sys.argv[3]
if os.environ.get("S1_COMPILATION_CONFIG"):
    kw["compilation_config"] = json.loads(os.environ["S1_COMPILATION_CONFIG"])
params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
if len(sys.argv) > 4:  # --profile-dir: the engine build, then the first generate, under cProfile: the top functions
    import cProfile, pstats  # by cumulative time in DIR/warm_profile.txt (the generate's in .generate.txt), the raw
    prof = cProfile.Profile()  # stats beside them (.prof) for pstats
    llm = prof.runcall(LLM, model=None if sys.argv[2] == "-" else sys.argv[2], **kw)
    print(f"STAGE engine built {time.time() - t0:.3f}", flush=True)
    gen = cProfile.Profile()
    gen.runcall(llm.generate, [[1, 2, 3, 4]], params)
    for p, path in ((prof, sys.argv[4]), (gen, sys.argv[4].replace(".txt", ".generate.txt"))):
        p.dump_stats(path.replace(".txt", ".prof"))
        with open(path, "w") as f:
            pstats.Stats(p, stream=f).sort_stats("cumulative").print_stats(80)
else:
    llm = LLM(model=None if sys.argv[2] == "-" else sys.argv[2], **kw)
    print(f"STAGE engine built {time.time() - t0:.3f}", flush=True)
    llm.generate([[1, 2, 3, 4]], params)
print(f"FIRST_TOKEN {time.time() - t0:.3f}")
print(f"DYNAMO_IMPORTED {int('torch._dynamo' in sys.modules)}")
"""
UNCOMPILED = json.dumps({"level": 0, "cudagraph_mode": "FULL"})
# the engines a step's suffix names: its compilation_config (None: the default)
VARIANTS = {"": None, "-uncompiled": UNCOMPILED, "-eager-pieces": json.dumps({"backend": "eager"})}


def _empty_caches(root: Path) -> dict[str, str]:
    """The environment with Inductor's and Triton's on-disk caches pointed at new, empty folders."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    env["TRITON_CACHE_DIR"] = str(root / "triton")
    return env


def _since(asctime: str, t0: float) -> str:
    """A log line's time ("2026-12-01 06:29:02,123", the child's local time) as seconds since t0, or "?"."""
    try:
        return f"{datetime.strptime(asctime, '%Y-%m-%d %H:%M:%S,%f').timestamp() - t0:.3f}"
    except ValueError:
        return "?"


def _first_token(model: str, cache: str, env: dict[str, str], profile: Path | None = None) -> float:
    """Seconds from spawning a Python process to its first generated token (cache: "eager", "-" for the
    default engine, or a precompiled directory); with `profile`, the engine build's cProfile table goes there."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", FIRST_TOKEN, str(t0), model, cache, *([str(profile)] * bool(profile))],
                          capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed: {proc.stderr[-2000:]}")
    # where the seconds went: the child's stage marks and, with GRAPHRUNNER_LOG_LEVEL=INFO, the engine's start-up
    # log lines (tokenizer, the runner's stages with the seconds since the previous one), all timed since spawn
    for line in proc.stdout.splitlines():
        if line.startswith("STAGE "):
            print(f"    [{cache}] at {line.rsplit(' ', 1)[1]} s: {line[6:].rsplit(' ', 1)[0]}", flush=True)
    for line in proc.stderr.splitlines():  # "<asctime> graphrunner pid=N <logger>: <message>"
        head, sep, message = line.partition(": ")
        if sep and " graphrunner pid=" in head:
            print(f"    [{cache}] at {_since(head[:23], t0)} s: {message}", flush=True)
    print(f"    [{cache}] torch._dynamo imported: {'yes' if 'DYNAMO_IMPORTED 1' in proc.stdout else 'no'}", flush=True)
    return float(proc.stdout.split("FIRST_TOKEN")[-1].split()[0])


def _precompile(model: str, out: Path, env: dict[str, str]) -> float:
    t0 = time.time()
    cmd = [sys.executable, "-m", "graphrunner", "precompile", "--out", str(out)]
    if model != "-":
        cmd += ["--model", model]
    if env.get("S1_COMPILATION_CONFIG"):
        cmd += ["--compilation-config", env["S1_COMPILATION_CONFIG"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"precompile failed: {proc.stderr[-2000:]}")
    return time.time() - t0


STEPS = ("eager", "warm-traced", *(f"{kind}{suffix}" for suffix in VARIANTS for kind in ("cold", "precompile", "warm")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="-", help="model directory (default: the shipped demo model)")
    ap.add_argument("--json", default="bench_startup.json")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help="which measurements, in this order (warm needs precompile before it)")
    ap.add_argument("--profile-dir", type=Path, default=None,
                    help="also run the warm start under cProfile (slower) and write its table to DIR/warm_profile.txt")
    args = ap.parse_args()
    order = args.steps.split(",")
    unknown = set(order) - set(STEPS)
    if unknown:
        ap.error(f"--steps: unknown {sorted(unknown)}; choose from {list(STEPS)}")
    for warm, pre in (("warm-traced", "precompile"), *((f"warm{x}", f"precompile{x}") for x in VARIANTS)):
        if warm in order and (pre not in order or order.index(pre) > order.index(warm)):
            ap.error(f"--steps: {warm} needs {pre} before it")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = root / "precompiled"

        def env_of(suffix: str, name: str) -> dict[str, str]:
            config = VARIANTS[suffix]
            return {**_empty_caches(root / name), **({"S1_COMPILATION_CONFIG": config} if config else {})}

        steps = {"eager": ("eager_first_token_s", lambda: _first_token(args.model, "eager", _empty_caches(root / "eager"))),
                 # the default's precompiled directory with its saved compilation unused (capture/aot.py): traced again
                 "warm-traced": ("warm_traced_first_token_s", lambda: _first_token(
                     args.model, str(cache), {**_empty_caches(root / "warm-t"), "GRAPHRUNNER_AOT": "0"}))}
        for suffix in VARIANTS:
            out, key = root / f"precompiled{suffix}", suffix.replace("-", "_")
            steps[f"cold{suffix}"] = (f"cold{key}_first_token_s", lambda x=suffix: _first_token(
                args.model, "-", env_of(x, f"cold{x}")))
            steps[f"precompile{suffix}"] = (f"precompile{key}_s", lambda x=suffix, o=out: _precompile(
                args.model, o, env_of(x, f"pre{x}")))
            steps[f"warm{suffix}"] = (f"warm{key}_first_token_s", lambda x=suffix, o=out: _first_token(
                args.model, str(o), env_of(x, f"warm{x}")))
        if args.profile_dir is not None:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            steps["warm-profiled"] = ("warm_profiled_first_token_s", lambda: _first_token(
                args.model, str(cache), _empty_caches(root / "warm-p"), args.profile_dir / "warm_profile.txt"))
            if "warm" in order:
                order.insert(order.index("warm") + 1, "warm-profiled")
        rows = {}
        for step in order:
            name, measure = steps[step]
            if name in rows:  # a step repeated (in turns with another: the host's speed drifts) keeps each figure
                name = f"{name}_{sum(k == name or k.startswith(name + '_') for k in rows) + 1}"
            rows[name] = measure()
            print(f"  {name:<22} {rows[name]:8.2f} s", flush=True)
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": sys.version.split()[0]}
    with open(args.json, "w") as f:
        json.dump({"script": "bench_startup", "env": env, "args": vars(args), "rows": rows}, f, indent=1, default=str)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
