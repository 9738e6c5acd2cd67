"""Profiler: torch.profiler behind vLLM's `LLM.start_profile()` / `LLM.stop_profile()`.

`start()` opens a torch.profiler session (CPU, plus CUDA when available); `stop()` writes a Chrome trace JSON
(open it in chrome://tracing or Perfetto) into the directory given, or named by `VLLM_TORCH_PROFILER_DIR`
(vLLM's variable) or `GRAPHRUNNER_TORCH_PROFILER_DIR`, and returns its path.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

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
