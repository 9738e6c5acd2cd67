"""graphrunner.host_tensors: the array-based list -> tensor path equals torch.tensor(list) for every staged dtype."""

from __future__ import annotations

from array import array

import pytest
import torch

from graphrunner.host_tensors import host_tensor, to_device


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bool])
@pytest.mark.parametrize("n", [0, 1, 3, 17, 4161])
def test_host_tensor_equals_torch_tensor(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        data: list = torch.randn(n, generator=g).tolist()
    elif dtype == torch.bool:
        data = (torch.rand(n, generator=g) > 0.5).tolist()
    else:
        hi = 2**31 - 1 if dtype == torch.int32 else 2**62
        data = [-(2**31) if dtype == torch.int32 else -(2**62)][:n] + \
            torch.randint(0, 1 << 30, (max(0, n - 1),), generator=g).tolist()[: max(0, n - 2)] + [hi][: max(0, n - 1)]
    got, want = host_tensor(data, dtype), torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(to_device(data, dtype, torch.device("cpu")), want)


def test_an_array_of_the_right_typecode_is_used_as_is_and_kept_alive() -> None:
    buf = array("i", [5, 6, 7])
    t = host_tensor(buf, torch.int32)
    del buf
    assert t.tolist() == [5, 6, 7]
    assert host_tensor(array("q", [1, 2]), torch.int32).dtype == torch.int32  # another typecode is converted


def test_values_out_of_range_raise_rather_than_wrap() -> None:
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)


def test_nested_lists_give_the_same_2d_tensor() -> None:
    data = [[1, 2, 3], [4, 5, 6]]
    assert torch.equal(host_tensor(data, torch.int32), torch.tensor(data, dtype=torch.int32))
