"""graphrunner.symm_all_reduce on CPU: the backend choice and which messages the symmetric buffer takes (the
all-reduce itself needs GPUs: test_gpu_tensor_parallel.py runs it against NCCL's tokens)."""

from __future__ import annotations

import pytest
import torch

from graphrunner import symm_all_reduce
from graphrunner.symm_all_reduce import ENV, MAX_BYTES, SymmBuffer, check_first_engine, chosen_backend, setup


@pytest.mark.parametrize(("value", "want"), [(None, "nccl"), ("", "nccl"), ("NCCL", "nccl"), (" symm_mem ", "symm_mem")])
def test_backend_choice(value: str | None, want: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert chosen_backend() == want


def test_a_bad_backend_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "custom")
    with pytest.raises(ValueError, match=f"{ENV} must be one of nccl, symm_mem, got 'custom'"):
        chosen_backend()


def test_no_buffer_on_cpu_or_with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "symm_mem")
    assert setup(None, torch.device("cpu")) is None  # type: ignore[arg-type] -- (never touches the group)
    monkeypatch.setenv(ENV, "nccl")
    assert setup(None, torch.device("cuda")) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("shape", "dtype", "fits"), [
    ((1, 4096), torch.bfloat16, True),                 # a batch-1 decode's hidden state
    ((MAX_BYTES // 2,), torch.bfloat16, True),         # exactly the buffer
    ((MAX_BYTES // 2 + 2,), torch.bfloat16, False),    # one element pair past it
    ((256, 4096), torch.float32, False),               # 4 MiB: NCCL
    ((0, 4096), torch.bfloat16, False),                # empty
    ((3,), torch.bfloat16, False),                     # 6 bytes: not a whole number of 4-byte words
    ((7, 3), torch.float32, True),
])
def test_which_messages_fit(shape: tuple[int, ...], dtype: torch.dtype, fits: bool) -> None:
    buf = SymmBuffer(torch.empty(MAX_BYTES, dtype=torch.uint8), "g")
    assert buf.fits(torch.empty(shape, dtype=dtype)) is fits
    assert not buf.fits(torch.empty(16, 8, dtype=torch.float32).t())  # not contiguous
    assert not buf.fits(torch.empty(8, dtype=torch.float32, device="meta"))  # another device


def test_a_second_engine_in_one_process_is_refused_not_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch keeps symmetric memory's group state per process: once set up, another engine asking for symm_mem on
    CUDA gets an error naming the switch (a second rendezvous hung on two H200s); NCCL and CPU engines still start."""
    monkeypatch.setenv(ENV, "symm_mem")
    check_first_engine(torch.device("cuda"))  # nothing set up yet
    monkeypatch.setattr(symm_all_reduce, "_SET_UP_IN_THIS_PROCESS", True)
    with pytest.raises(RuntimeError, match=f"{ENV}=symm_mem serves only the first tensor-parallel engine"):
        check_first_engine(torch.device("cuda"))
    check_first_engine(torch.device("cpu"))
    monkeypatch.setenv(ENV, "nccl")
    check_first_engine(torch.device("cuda"))
    monkeypatch.setenv(ENV, "custom")
    with pytest.raises(ValueError, match=f"{ENV} must be one of"):
        check_first_engine(torch.device("cpu"))  # a bad value fails whatever else holds
