"""Profiler: torch.profiler behind vLLM's `LLM.start_profile()` / `LLM.stop_profile()`.

`start()` opens a torch.profiler session (CPU, plus CUDA when available); `stop()` writes a Chrome trace JSON
(open it in chrome://tracing or Perfetto) into the directory given, or named by `VLLM_TORCH_PROFILER_DIR`
(vLLM's variable) or `GRAPHRUNNER_TORCH_PROFILER_DIR`, and returns its path.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

PROFILER_DIR_ENV_VARS: tuple[str, ...] = ("VLLM_TORCH_PROFILER_DIR", "GRAPHRUNNER_TORCH_PROFILER_DIR")
_trace_seq = itertools.count()


def resolve_profiler_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The trace directory: `directory` if given, else the first non-empty env var of PROFILER_DIR_ENV_VARS."""
    if directory is not None and str(directory) != "":
        return Path(directory).expanduser()
    for var in PROFILER_DIR_ENV_VARS:
        value = os.environ.get(var, "")
        if value:
            return Path(value).expanduser()
    raise ValueError("profiler output directory is not set: pass a directory or set the environment variable "
                     f"{PROFILER_DIR_ENV_VARS[0]} (vLLM's) or {PROFILER_DIR_ENV_VARS[1]} to a writable path")


@dataclass
class ProfilerConfig:
    """vLLM's `ProfilerConfig` (the fields graphrunner acts on): `LLM(profiler_config=ProfilerConfig(...))`, or the
    same keys as a dict. Only the torch profiler exists; the trace covers start_profile() .. stop_profile(), so
    delay_iterations / max_iterations other than 0 are refused."""

    profiler: str | None = None  # "torch" (None: torch too, vLLM <= 0.11 style, with the directory from the env)
    torch_profiler_dir: str = ""
    delay_iterations: int = 0
    max_iterations: int = 0

    @classmethod
    def coerce(cls, value: Any) -> ProfilerConfig:
        """A ProfilerConfig from None, a dict of its fields or a ProfilerConfig; ValueError naming what is wrong."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            cfg = dataclasses.replace(value)
        elif isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"profiler_config: unsupported key(s) {unknown}; known: profiler, torch_profiler_dir,"
                                 f" delay_iterations, max_iterations")
            cfg = cls(**value)
        else:
            raise ValueError(f"profiler_config must be a dict or a ProfilerConfig, got {type(value).__name__}")
        if cfg.profiler not in (None, "torch"):
            raise ValueError(f"profiler_config: only the 'torch' profiler exists, got {cfg.profiler!r}")
        if cfg.delay_iterations or cfg.max_iterations:
            raise ValueError("profiler_config: delay_iterations / max_iterations are not supported (the trace covers "
                             "start_profile() to stop_profile())")
        return cfg


class Profiler:
    """One torch.profiler session at a time: start(dir) ... stop() -> path of the Chrome trace JSON."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = directory  # default for start(); None = read the env vars at start()
        self._prof: profile | None = None
        self._dir: Path | None = None

    @property
    def is_running(self) -> bool:
        return self._prof is not None

    def start(self, directory: str | os.PathLike[str] | None = None) -> None:
        """Begin profiling; the trace will go to `directory` (else the constructor's, else the env vars)."""
        if self._prof is not None:
            raise ValueError("profiler is already running: call stop() before starting it again")
        out_dir = resolve_profiler_dir(directory if directory is not None else self.directory)
        out_dir.mkdir(parents=True, exist_ok=True)  # fail now, not after the run being profiled
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities, record_shapes=False, with_stack=False)
        prof.start()
        self._prof, self._dir = prof, out_dir

    def stop(self) -> Path:
        """End profiling and write the Chrome trace; returns the file's path."""
        prof, out_dir = self._prof, self._dir
        if prof is None or out_dir is None:
            raise ValueError("profiler is not running: call start() first")
        self._prof = self._dir = None  # the session is over even if the export below fails
        prof.stop()
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = out_dir / f"graphrunner_trace_{stamp}_pid{os.getpid()}_{next(_trace_seq)}.json"
        prof.export_chrome_trace(str(path))
        return path
