"""Test configuration: Triton runs in interpreter mode on machines without CUDA; `-m gpu` tests skip there."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()

# Must happen before any module decorates a Triton kernel: without a GPU, kernels run on CPU tensors.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Engines built without an explicit device run on CPU in tests, also on a GPU machine: the CPU tests
# compare against fp32 CPU references (and module-scoped fixtures are built before any per-test
# fixture could change this). GPU tests pass device="cuda" explicitly.
os.environ["GRAPHRUNNER_DEVICE"] = "cpu"

from graphrunner.config import NEEDS_INTERPRETER  # (imported after TRITON_INTERPRET is set)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")



def _skip_interpreter_refusals(item: pytest.Item) -> Iterator[None]:
    """On a CUDA machine Triton's interpreter stays off (it would take over every kernel), so a CPU test that
    builds an engine with Triton kernels on CPU tensors is refused by the engine: that test is skipped, naming
    why, instead of failing. Its GPU counterparts (`-m gpu`) cover those kernels on CUDA."""
    outcome = yield
    error = outcome.excinfo[1] if outcome.excinfo else None
    if (_HAS_CUDA and not os.environ.get("TRITON_INTERPRET") and isinstance(error, ValueError)
            and NEEDS_INTERPRETER in str(error) and item.get_closest_marker("gpu") is None):
        outcome.force_exception(pytest.skip.Exception(
            f"a CPU test of Triton kernels (Triton's interpreter is off on a CUDA machine): {error}"))


pytest_runtest_setup = pytest.hookimpl(hookwrapper=True)(_skip_interpreter_refusals)  # module-scoped engines
pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(_skip_interpreter_refusals)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
