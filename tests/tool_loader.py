"""Test helper (not a test module): load a script of tools/ as a module, as it runs from the command line.

tools/ is not a package: its scripts import their siblings (kernel_table, bench_http, ...) through tools/ on
sys.path, and dataclasses resolve their module by name in sys.modules, so both are set up here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as the module `name` (the one already loaded, if any)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
