"""Opt-in log output for graphrunner's own loggers: GRAPHRUNNER_LOG_LEVEL=INFO (or DEBUG) sends the "graphrunner"
loggers to stderr with a timestamp and process id, in the engine's process and in each tensor-parallel worker (a
spawned process has no logging set up). Unset, nothing is configured (the application's logging decides).
"""

from __future__ import annotations

import logging
import os
import sys

ENV = "GRAPHRUNNER_LOG_LEVEL"
_MARK = "_graphrunner_env_handler"


def configure_from_env(prefix: str = "") -> None:
    """Attach one stderr handler to the "graphrunner" logger at $GRAPHRUNNER_LOG_LEVEL (once per process); `prefix`
    names the process in every line (e.g. "tp1")."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return
    level = logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        raise ValueError(f"{ENV} must be a logging level name (DEBUG, INFO, WARNING, ...), got {raw!r}")
    logger = logging.getLogger("graphrunner")
    logger.setLevel(level)
    if any(getattr(h, _MARK, False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    tag = f" {prefix}" if prefix else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s graphrunner{tag} pid=%(process)d %(name)s: %(message)s"))
    setattr(handler, _MARK, True)
    logger.addHandler(handler)
