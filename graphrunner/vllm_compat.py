"""Run code written for vLLM's offline API on graphrunner, unchanged: a `vllm` -> `graphrunner` module alias.

`install_vllm_alias()` puts an import hook on `sys.meta_path` so that `import vllm` and the vLLM submodules that
offline scripts import resolve to graphrunner's modules (the same module and class objects, not copies):

    vllm                        LLM, LLMEngine, EngineArgs, SamplingParams, RequestOutput, ... (graphrunner's names)
    vllm.outputs                graphrunner.outputs
    vllm.sampling_params        graphrunner.sampling_params
    vllm.inputs                 graphrunner.inputs
    vllm.logprobs               Logprob (graphrunner.outputs)
    vllm.utils                  FlexibleArgumentParser (vLLM <= 0.11 imported it from here)
    vllm.utils.argparse_utils   graphrunner.argparse_utils
    vllm.engine.arg_utils       graphrunner.engine_args
    vllm.engine.llm_engine      graphrunner.llm_engine
    vllm.entrypoints.llm        graphrunner.llm
    vllm.distributed            cleanup_dist_env_and_memory, ... (graphrunner.distributed)
    vllm.distributed.parallel_state   the same three helpers
    vllm.v1.metrics.reader      graphrunner.metrics (Metric, Counter, Gauge, Vector, Histogram)
    vllm.config                 ProfilerConfig (graphrunner.profiler)

Modules load when first imported, so installing the alias costs nothing. Models are still local directories only:
a script's hard-coded hub id ("facebook/opt-125m") must be replaced by a path. README.md ("vLLM compatibility")
lists what differs.

`python -m graphrunner.vllm_compat SCRIPT [ARGS...]` installs the alias and runs SCRIPT as `__main__` with
`sys.argv = [SCRIPT, *ARGS]`, as `python SCRIPT ARGS...` would with vLLM installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import types
from collections.abc import Sequence
from typing import Any

# vLLM module -> the graphrunner module that IS it (sys.modules holds the graphrunner module under both names)
ALIASES: dict[str, str] = {
    "vllm.outputs": "graphrunner.outputs",
    "vllm.sampling_params": "graphrunner.sampling_params",
    "vllm.inputs": "graphrunner.inputs",
    "vllm.utils.argparse_utils": "graphrunner.argparse_utils",
    "vllm.engine.arg_utils": "graphrunner.engine_args",
    "vllm.engine.llm_engine": "graphrunner.llm_engine",
    "vllm.entrypoints.llm": "graphrunner.llm",
    "vllm.v1.metrics.reader": "graphrunner.metrics",
}

_DIST = {name: "graphrunner.distributed" for name in
         ("cleanup_dist_env_and_memory", "destroy_model_parallel", "destroy_distributed_environment")}

# vLLM package with no graphrunner counterpart -> {exported name: graphrunner module it comes from}. These are
# synthetic modules (packages: `__path__ = []`) whose names load on first access.
PACKAGES: dict[str, dict[str, str]] = {
    "vllm": {},  # filled from graphrunner's public names below
    "vllm.utils": {"FlexibleArgumentParser": "graphrunner.argparse_utils"},
    "vllm.engine": {},
    "vllm.entrypoints": {"LLM": "graphrunner.llm"},
    "vllm.v1": {},
    "vllm.v1.metrics": {},
    "vllm.distributed": dict(_DIST),
    "vllm.distributed.parallel_state": dict(_DIST),
    "vllm.logprobs": {"Logprob": "graphrunner.outputs"},
    "vllm.config": {"ProfilerConfig": "graphrunner.profiler"},
}


def _public_names() -> dict[str, str]:
    import graphrunner

    return {name: graphrunner._PUBLIC[name] for name in graphrunner.__all__}


def _known(name: str) -> bool:
    return name in ALIASES or name in PACKAGES


class _SyntheticModule(types.ModuleType):
    """A vLLM module graphrunner has no file for: re-exports graphrunner names, and exposes its known submodules
    as attributes (importing them on first access, as `import vllm; vllm.outputs` works with vLLM)."""

    def __getattr__(self, attr: str) -> Any:
        exports = PACKAGES.get(self.__name__, {})
        if attr in exports:
            value = getattr(importlib.import_module(exports[attr]), attr)
        elif _known(f"{self.__name__}.{attr}"):
            value = importlib.import_module(f"{self.__name__}.{attr}")
        else:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r} (graphrunner's vLLM alias "
                                 f"provides {sorted(exports) or 'submodules only'}; see graphrunner.vllm_compat)")
        setattr(self, attr, value)
        return value

    def __dir__(self) -> list[str]:
        subs = {k.rpartition(".")[2] for k in (*ALIASES, *PACKAGES) if k.rpartition(".")[0] == self.__name__}
        return sorted({*super().__dir__(), *PACKAGES.get(self.__name__, {}), *subs})


class _VllmAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `vllm` and the submodules above; loads a synthetic module, or swaps in the graphrunner module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not _known(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in PACKAGES)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _SyntheticModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name in ALIASES:
            # The import system returns whatever sys.modules holds after exec_module: the graphrunner module itself.
            sys.modules[name] = importlib.import_module(ALIASES[name])
            return
        module.__doc__ = f"graphrunner's stand-in for vLLM's {name} (graphrunner.vllm_compat)."
        module.__all__ = sorted(PACKAGES[name])


_finder: _VllmAliasFinder | None = None


def install_vllm_alias() -> None:
    """Make `import vllm` (and `vllm.*` submodules listed in this module) resolve to graphrunner. Idempotent.
    RuntimeError when a real vLLM was imported already in this process."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        return
    loaded = sys.modules.get("vllm")
    if loaded is not None and not isinstance(loaded, _SyntheticModule):
        raise RuntimeError("a real vllm package is already imported in this process; install the graphrunner alias "
                           "before anything imports vllm")
    if not PACKAGES["vllm"]:
        PACKAGES["vllm"].update(_public_names())
    _finder = _VllmAliasFinder()
    sys.meta_path.insert(0, _finder)


def uninstall_vllm_alias() -> None:
    """Remove the import hook and every `vllm` / `vllm.*` entry it put in sys.modules."""
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def run_script(script: str, args: Sequence[str] = ()) -> None:
    """Run `script` as `__main__` under the alias, with sys.argv = [script, *args] and its folder on sys.path."""
    install_vllm_alias()
    path = os.fspath(script)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such script: {path}")
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


_USAGE = "usage: python -m graphrunner.vllm_compat SCRIPT [ARGS...]  (runs a script written for vLLM on graphrunner)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    if not os.path.isfile(argv[0]):
        print(f"graphrunner.vllm_compat: error: no such script: {argv[0]}", file=sys.stderr)
        return 2
    run_script(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
