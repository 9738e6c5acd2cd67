"""The manifest of a precompiled artifact directory: what the compiled code was built for.

A warm start compares it field by field with the current run and refuses a mismatch with a
message naming the field, so stale or foreign compiled code is never silently used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from graphrunner.config import DEFAULT_COMPILE_BACKEND

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2  # 2: capture_sizes are the piecewise token buckets, plus full_sizes
# Environment switches that change no traced code (logging, timeouts, host-side knobs); every other GRAPHRUNNER_*
# variable is part of the key, since Dynamo keeps module-level switches (GRAPHRUNNER_FUSED_ADD_NORM, ...) as
# constants of the trace without guarding them
_KEYLESS_ENV = ("GRAPHRUNNER_LOG_LEVEL", "GRAPHRUNNER_TP_TIMEOUT_S", "GRAPHRUNNER_GC_FREEZE", "GRAPHRUNNER_AOT")


def model_hash(model_dir: Path) -> str:
    """sha256 over config.json and the names and sizes of the weight files (not their bytes: fast)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()


def _device_facts(device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        return "cpu", ""
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"{major}.{minor}"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # CPU-only installs may lack Triton
        return ""
    return triton.__version__


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model_hash: str
    dtype: str
    torch_version: str
    triton_version: str
    device_name: str
    device_capability: str
    capture_sizes: tuple[int, ...]  # piecewise token buckets (empty: no CUDA graphs)
    full_sizes: tuple[int, ...] = ()  # FULL decode graph batch sizes
    # ranks the model is split over: each rank's compiled pieces have its shard's shapes and its collectives
    tensor_parallel_size: int = 1
    compiled: bool = True  # the model compiled (Inductor's pieces and the saved compilation) or run as it is
    compile_backend: str = "inductor"  # the compiled model's piece compiler ("inductor", "eager"); "" uncompiled

    @classmethod
    def current(cls, model_dir: Path, dtype: torch.dtype, device: torch.device,
                capture_sizes: tuple[int, ...], full_sizes: tuple[int, ...] = (),
                tensor_parallel_size: int = 1, compiled: bool = True,
                compile_backend: str = DEFAULT_COMPILE_BACKEND) -> Manifest:
        name, capability = _device_facts(device)
        return cls(FORMAT_VERSION, model_hash(model_dir), str(dtype).removeprefix("torch."), torch.__version__,
                   _triton_version(), name, capability, tuple(capture_sizes), tuple(full_sizes),
                   tensor_parallel_size, compiled, compile_backend if compiled else "")

    def save(self, out_dir: Path) -> None:
        (out_dir / MANIFEST_NAME).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, cache_dir: Path) -> Manifest:
        path = cache_dir / MANIFEST_NAME
        if not path.is_file():
            raise ValueError(f"compile cache {cache_dir} has no {MANIFEST_NAME}; build it with `graphrunner precompile`")
        try:
            raw = json.loads(path.read_text())
            raw["capture_sizes"] = tuple(raw["capture_sizes"])
            raw["full_sizes"] = tuple(raw.get("full_sizes", ()))
            raw.setdefault("tensor_parallel_size", 1)  # written before tensor parallelism: one rank
            raw.setdefault("compiled", True)  # written before uncompiled engines could be precompiled
            raw.setdefault("compile_backend", "inductor" if raw["compiled"] else "")  # before eager pieces
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"compile cache manifest {path} is unreadable: {exc}") from exc

    def check_matches(self, current: Manifest, cache_dir: Path) -> None:
        """Raise ValueError naming every field where the cache differs from this run."""
        diffs = [f"{f.name}: cache has {getattr(self, f.name)!r}, this run has {getattr(current, f.name)!r}"
                 for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(current, f.name)]
        if not diffs:
            return
        hint = ""
        if self.compile_backend != current.compile_backend and self.compile_backend and current.compile_backend:
            # (a directory precompiled before eager pieces became the default is an Inductor one)
            hint = (f", or start with compilation_config={{'backend': {self.compile_backend!r}}} "
                    f"(CLI: -O '{{\"backend\": \"{self.compile_backend}\"}}'), the piece compiler it was built with")
        raise ValueError(f"compile cache {cache_dir} was built for a different setup; refusing it "
                         f"({'; '.join(diffs)}). Rebuild it with `graphrunner precompile`{hint}.")


def code_key() -> str:
    """sha256 over what a saved traced graph (capture/aot.py, capture/saved_graph.py) was made from beyond the
    manifest's model, dtype and device: the source of graphrunner, model_states and capture, the GEMV table in use,
    the GRAPHRUNNER_* switches and torch's version."""
    import model_states.base
    from graphrunner.models import gemv

    h = hashlib.sha256(torch.__version__.encode())
    for root in (Path(gemv.__file__).parents[1], Path(model_states.base.__file__).parent, Path(__file__).parent):
        for path in sorted(root.rglob("*.py")):
            h.update(f"{path.relative_to(root.parent)}\0".encode() + path.read_bytes())
    table = os.environ.get("GRAPHRUNNER_GEMV_CONFIGS") or gemv.TUNED_CONFIGS_FILE
    if Path(table).is_file():
        h.update(Path(table).read_bytes())
    for name in sorted(os.environ):
        if name.startswith("GRAPHRUNNER_") and name not in _KEYLESS_ENV:
            h.update(f"{name}={os.environ[name]}\0".encode())
    return h.hexdigest()
