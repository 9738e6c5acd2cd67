"""The qkv projection's split-K partials handed to the attention prologue: where the GEMV config serving this token
count splits K, the GEMV stores its float32 partials unsummed and the prologue kernel (qkv_prep.py) sums them in
split order, so the GEMV skips its split-K tail (models/linear_add_norm.py does the same for o and down). Bit-equal
to the GEMV with its tail, then the prologue. GRAPHRUNNER_QKV_PARTIALS=0: off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphrunner.attention import decode_prep
from graphrunner.env import env_choice
from graphrunner.kernel_checks import interpreted
from graphrunner.models import gemv
from graphrunner.models.gemv import MAX_M, config_for, routes_to_gemv, split_plan
from graphrunner.models.linear_add_norm import gemv_partials
from graphrunner.opaque import opaque_op

ENABLED = env_choice("GRAPHRUNNER_QKV_PARTIALS", ("0", "1"), "1") == "1"


def capacity(n: int, k: int) -> int:
    """The most splits a tuned config of W [N, K] makes (0 where none splits K): the partials buffer holds that many
    [MAX_M, N] slices. A constant at trace time (the projection op's output shape), as gemv.is_tuned."""
    splits = [split_plan(k, c)[1] for c in gemv.tuned_configs().get((n, k), ())] if k else []
    return max((s for s in splits if s > 1), default=0)


capacity._dynamo_marked_constant = True  # type: ignore[attr-defined]  (see gemv.is_tuned)


def routes(x: Tensor, weight: Tensor) -> bool:
    """Whether SelfAttention hands this projection's partials to the prologue (decided at trace time, from metadata):
    the switch on, the prologue kernel outside attention (decode_prep off), and a weight `linear()` sends to the
    GEMV with a tuned config that splits K."""
    return (ENABLED and not decode_prep.DECODE_PREP and x.dim() == 2 and routes_to_gemv(weight)
            and capacity(int(weight.shape[0]), int(weight.shape[1])) > 1)


def splits_at(m: int, n: int, k: int, device: torch.device) -> int:
    """How many partials the projection of M tokens of W [N, K] leaves for the prologue (0: it leaves the summed
    qkv row instead). The producer and the consumer both ask, so they agree at every M."""
    if device.type != "cuda" or interpreted() or not 1 <= m <= MAX_M or not k:
        return 0
    config = config_for(m, n, k, device)
    splits = split_plan(k, config)[1] if config is not None else 1
    return splits if 1 < splits <= capacity(n, k) else 0


def parts_view(parts: Tensor, splits: int, m: int, n: int) -> Tensor:  # [S, M, N] float32
    """The front of the flat partials buffer [capacity * MAX_M * N] as the GEMV stores it."""
    return parts[: splits * m * n].view(splits, m, n)


def qkv_from_parts_ref(parts: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:  # [M, N]
    """PyTorch reference: the partials [S, M, N] float32 summed in split order from zero (the GEMV tail's order),
    plus the bias, rounded once to `dtype`: the qkv row the GEMV with its tail would have written."""
    total = torch.zeros_like(parts[0])
    for s in range(parts.shape[0]):
        total = total + parts[s]
    if bias is not None:
        total = total + bias.float()
    return total.to(dtype)


def qkv_projection(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """x [M, K] @ weight [N, K]^T (+ bias) as (qkv [M, N], parts [capacity * MAX_M * N] float32): where
    splits_at(M) > 1 the GEMV's partials fill the front of `parts` and qkv is left unwritten (the prologue sums the
    partials and adds the bias); otherwise qkv is the small-M linear's output and `parts` is unused. Traced: the
    opaque op graphrunner::qkv_projection."""
    if torch.compiler.is_compiling():
        return torch.ops.graphrunner.qkv_projection(x, weight, bias)
    return _qkv_projection(x, weight, bias)


def _qkv_projection(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    m, k, n = x.shape[0], x.shape[1], weight.shape[0]
    parts = torch.empty(capacity(n, k) * MAX_M * n, dtype=torch.float32, device=x.device)
    splits = splits_at(m, n, k, x.device)
    if not splits:
        return gemv._small_m_linear(x, weight, bias), parts
    config = config_for(m, n, k, x.device)
    assert config is not None
    gemv.check_inputs(x, weight, bias)  # (the bias is the prologue's to add)
    gemv_partials(x, weight, config, out=parts_view(parts, splits, m, n))
    return torch.empty(m, n, dtype=x.dtype, device=x.device), parts


@opaque_op("qkv_projection", _qkv_projection).register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    n, k = weight.shape
    return (x.new_empty(x.shape[0], n),
            x.new_empty(capacity(int(n), int(k)) * MAX_M * int(n), dtype=torch.float32))
