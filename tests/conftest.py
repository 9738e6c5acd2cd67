"""Test configuration: Triton runs in interpreter mode on machines without CUDA; `-m gpu` tests skip there."""

from __future__ import annotations

import os

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
