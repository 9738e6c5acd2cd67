"""Compile for the H200 (sm_90) every Triton kernel that some CPU tests launch, without a GPU: catches what the
interpreter lets through (types that differ between the branches of an `if`, unsupported ops) before device time.

Step 1 runs the tests under TRITON_INTERPRET=1 in a child process and records each launch's kernel, argument types
and constexpr values; step 2 (this process, interpreter off) compiles each distinct one ahead of time with Triton's
bundled ptxas. It says nothing about speed or numerics: the tests do. Example:
    python tools/check_sm90.py tests/test_rejection_sampler.py tests/test_state_kernels.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_POINTER = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
            "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}
_OPTIONS = ("num_warps", "num_stages")


def arg_type(value: Any) -> str | None:
    """Triton's signature type of one runtime argument; None for one this tool cannot type."""
    import torch

    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        return "*" + _POINTER[name] if name in _POINTER else None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def _record_plugin(out_path: str) -> Any:
    """A pytest plugin that records each interpreted kernel launch into out_path (JSON lines)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
        sig: dict[str, str] = {}
        consts: dict[str, Any] = {}
        for name, param in params.items():
            value = bound.get(name, param.default)
            if "constexpr" in str(param.annotation):
                sig[name], consts[name] = "constexpr", value
                continue
            kind = arg_type(value)
            if kind is None:  # untypable (None, a tuple ...): leave this launch out
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            sig[name] = kind
        entry = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": sig, "constexprs": consts,
                 "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}
        key = json.dumps(entry, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            with open(out_path, "a") as f:
                f.write(key + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    class Plugin:
        def pytest_configure(self, config: Any) -> None:
            InterpretedFunction.run = run  # type: ignore[method-assign]

    return Plugin()


def record(tests: list[str], out_path: str) -> int:
    import pytest

    return int(pytest.main(["-q", "-p", "no:cacheprovider", *tests], plugins=[_record_plugin(out_path)]))


def compile_all(entries: list[dict[str, Any]], arch: int) -> list[str]:
    """Compile each recorded launch for sm_<arch>; returns the failures, one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for e in entries:
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        what = f"{e['module']}.{e['name']} {e['constexprs']}"
        try:
            src = ASTSource(fn=kernel, signature=e["signature"], constexprs=e["constexprs"])
            triton.compile(src, target=target, options=e["options"])
            print(f"ok    {what}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- every failure is reported, then the next kernel
            first = str(exc).strip().splitlines()
            failures.append(f"{what}: {type(exc).__name__}: {first[0] if first else ''}")
            print(f"FAIL  {failures[-1]}", flush=True)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="+", help="pytest paths whose kernel launches are compiled")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90: H200)")
    ap.add_argument("--record-to", default=None, help=argparse.SUPPRESS)  # the child's side of step 1
    args = ap.parse_args()
    if args.record_to is not None:
        return record(args.tests, args.record_to)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: step 2 needs Triton's compiler (step 1 sets it itself)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "launches.jsonl")
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
            "PYTHONPATH", "")]))
        rc = subprocess.call([sys.executable, __file__, "--record-to", out, *args.tests], cwd=ROOT, env=env)
        if rc != 0:
            print(f"step 1: the tests failed (pytest exit {rc}); compiling what they launched anyway")
        entries = [json.loads(line) for line in Path(out).read_text().splitlines()] if Path(out).exists() else []
    sys.path.insert(0, str(ROOT))
    print(f"step 2: {len(entries)} distinct launches, compiled for sm_{args.arch}")
    failures = compile_all(entries, args.arch)
    print(f"{len(entries) - len(failures)} compiled, {len(failures)} failed")
    return 1 if failures or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
