"""Layering rule (docs/LAYERS.md): core < model_states < runner | capture < front. Every import in graphrunner/,
model_states/ and capture/ (top-level, lazy, TYPE_CHECKING, try/except) must point to its own layer or a lower
one, and runner and capture never import each other. Importing graphrunner.config must not load the front.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("graphrunner", "model_states", "capture")
# Front: the package __init__, these modules, and everything under these packages (present or future).
FRONT_MODULES = {"graphrunner", "graphrunner.__main__"} | {
    f"graphrunner.{m}" for m in ("llm", "llm_engine", "engine", "worker", "cli", "engine_args", "precompile",
                                 "vllm_compat", "async_llm", "tp_executor", "engine_core",
                                 "engine_core_process", "output_stream")
}
FRONT_PACKAGES = ("graphrunner.server", "graphrunner.entrypoints")
RUNNER_MODULES = {"graphrunner.runner"}
RUNNER_PACKAGES = ("graphrunner.spec_decode",)
RANK = {"core": 0, "model_states": 1, "runner": 2, "capture": 2, "front": 3}

Edge = tuple[str, str, str, int]  # importer, imported, file, line


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> str:
    if _under(module, ("capture",)):
        return "capture"
    if _under(module, ("model_states",)):
        return "model_states"
    if module in FRONT_MODULES or _under(module, FRONT_PACKAGES):
        return "front"
    if module in RUNNER_MODULES or _under(module, RUNNER_PACKAGES):
        return "runner"
    return "core"


def is_violation(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    return RANK[b] > RANK[a] or {a, b} == {"runner", "capture"}


def discover(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the three packages."""
    modules: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest prefix of `name` that is a module of the repo; None for stdlib/third-party."""
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return parts[0]


def imports_in(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement anywhere in `source`, relative ones resolved."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, known) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [_resolve(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, known) for a in node.names]
        else:
            continue
        found.extend((t, node.lineno) for t in dict.fromkeys(targets) if t is not None)
    return sorted(found, key=lambda t: t[1])


def all_edges() -> list[Edge]:
    modules = discover()
    known = set(modules)
    edges: list[Edge] = []
    for name, path in modules.items():
        rel = str(path.relative_to(ROOT))
        for target, line in imports_in(path.read_text(), name, path.name == "__init__.py", known):
            edges.append((name, target, rel, line))
    return edges


def test_checker_finds_lazy_type_checking_and_relative_imports() -> None:
    src = (
        "import os\nfrom typing import TYPE_CHECKING\nfrom graphrunner.config import ModelConfig\n"
        "if TYPE_CHECKING:\n    from model_states.base import ModelState\n"
        "def f():\n    from . import engine\n    from .worker import build_runner\n"
        "try:\n    import capture.manager\nexcept ImportError:\n    pass\n"
        "from capture import cuda_piece\nfrom graphrunner import LLM\n"
    )
    known = {"graphrunner", "graphrunner.config", "graphrunner.engine", "graphrunner.worker", "model_states.base",
             "capture", "capture.manager", "capture.cuda_piece"}
    found = imports_in(src, "graphrunner.loader", False, known)
    assert found == [("graphrunner.config", 3), ("model_states.base", 5), ("graphrunner.engine", 7),
                     ("graphrunner.worker", 8), ("capture.manager", 10), ("capture.cuda_piece", 13),
                     ("graphrunner", 14)]
    assert imports_in("from . import x\nfrom .. import config\n", "graphrunner.sampling", True,
                      {"graphrunner.sampling.x", "graphrunner.config"}) == [
        ("graphrunner.sampling.x", 1), ("graphrunner.config", 2)]
    assert [layer_of(m) for m in ("graphrunner.config", "graphrunner.models.qwen3", "model_states.base",
                                  "graphrunner.runner", "graphrunner.spec_decode.eagle", "capture.manager",
                                  "graphrunner", "graphrunner.engine", "graphrunner.server.http")] == [
        "core", "core", "model_states", "runner", "runner", "capture", "front", "front", "front"]
    assert is_violation("graphrunner.loader", "model_states.registry")
    assert is_violation("capture.manager", "graphrunner.runner") and is_violation("graphrunner.runner", "capture")
    assert not is_violation("capture.manager", "graphrunner.step_plan")
    assert not is_violation("graphrunner.worker", "capture.manager")


def test_imports_point_down_the_layers() -> None:
    edges = all_edges()
    assert len({e[0] for e in edges}) > 30 and len(edges) > 80, "the walk found too few modules or imports"
    bad = [e for e in edges if is_violation(e[0], e[1])]
    lines = [f"{f}:{n}: {a} -> {b} ({layer_of(a)} -> {layer_of(b)})" for a, b, f, n in sorted(bad, key=lambda e: e[2:])]
    if lines:
        pytest.fail("imports pointing up the layer stack (see docs/LAYERS.md):\n" + "\n".join(lines), pytrace=False)


def test_importing_config_does_not_load_the_front() -> None:
    script = (
        "import graphrunner.config, sys, json\n"
        "leaked = sorted(m for m in sys.modules if m in ('graphrunner.engine', 'graphrunner.llm')"
        " or m.split('.')[0] in ('model_states', 'capture'))\n"
        "from graphrunner import LLM, SamplingParams\n"
        "print(json.dumps({'leaked': leaked, 'api': [LLM.__name__, SamplingParams.__name__]}))\n"
    )
    cmd = [sys.executable, "-c", script]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["api"] == ["LLM", "SamplingParams"]
    assert result["leaked"] == [], f"`import graphrunner.config` loaded {result['leaked']}: make __init__ lazy"
