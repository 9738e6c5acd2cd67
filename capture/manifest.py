"""The manifest of a precompiled artifact directory: what the compiled code was built for.

A warm start compares it field by field with the current run and refuses a mismatch with a
message naming the field, so stale or foreign compiled code is never silently used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2  # 2: capture_sizes are the piecewise token buckets, plus full_sizes


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

    @classmethod
    def current(cls, model_dir: Path, dtype: torch.dtype, device: torch.device,
                capture_sizes: tuple[int, ...], full_sizes: tuple[int, ...] = (),
                tensor_parallel_size: int = 1, compiled: bool = True) -> Manifest:
        name, capability = _device_facts(device)
        return cls(FORMAT_VERSION, model_hash(model_dir), str(dtype).removeprefix("torch."), torch.__version__,
                   _triton_version(), name, capability, tuple(capture_sizes), tuple(full_sizes),
                   tensor_parallel_size, compiled)

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
            return cls(**raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"compile cache manifest {path} is unreadable: {exc}") from exc

    def check_matches(self, current: Manifest, cache_dir: Path) -> None:
        """Raise ValueError naming every field where the cache differs from this run."""
        diffs = [f"{f.name}: cache has {getattr(self, f.name)!r}, this run has {getattr(current, f.name)!r}"
                 for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(current, f.name)]
        if diffs:
            raise ValueError(f"compile cache {cache_dir} was built for a different setup; refusing it "
                             f"({'; '.join(diffs)}). Rebuild it with `graphrunner precompile`.")
