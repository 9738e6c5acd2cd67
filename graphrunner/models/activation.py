"""The gated SiLU of Llama/Qwen MLPs, silu(gate) * up over a fused [T, 2I] gate-up output: the PyTorch reference,
the one-kernel Triton version, and the per-tile `silu_mul` helper the GEMV's prologue (models/gemv.py) shares with
it, so the activation has the same bits wherever it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from graphrunner.kernel_checks import check_tensor


def _check(gate_up: Tensor) -> None:
    check_tensor(gate_up, "gate_up", (torch.float32, torch.bfloat16, torch.float16), 2, None)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up [T, {gate_up.shape[1]}] must hold gate and up halves of equal width")


def silu_mul_ref(gate_up: Tensor) -> Tensor:  # [T, I]
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up in gate_up's dtype (PyTorch eager numerics: each op
    computes in float32 and rounds to the dtype)."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_mul(g, u):
    """silu(g) * u for loaded tiles, rounded like eager PyTorch: silu in float32 then to g's dtype, the product in
    float32 then to g's dtype."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + offs, silu_mul(g, u), mask=mask)


def silu_mul_triton(gate_up: Tensor) -> Tensor:  # [T, I]
    """silu_mul_ref's contract in one kernel (one launch where eager PyTorch takes two)."""
    _check(gate_up)
    t, width = gate_up.shape
    half = width // 2
    out = torch.empty(t, half, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or half == 0:
        return out
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    block = min(1024, triton.next_power_of_2(half))
    _silu_mul_kernel[(t, triton.cdiv(half, block))](gate_up, out, half, gate_up.stride(0), out.stride(0),
                                                     BLOCK=block, num_warps=4)
    return out
