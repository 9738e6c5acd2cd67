"""The Triton attention as a torch custom op: opcheck passes, and torch.compile keeps it opaque
(one node in the captured graph) while the compiled function equals eager execution.
"""

from __future__ import annotations

import torch

from graphrunner.attention.testing import contiguous_batch
from graphrunner.attention.triton_attention import unified_attention


def _case() -> tuple:
    torch.manual_seed(0)
    meta, cache = contiguous_batch([1, 5, 2], [3, 5, 20], 1, 2, 16, 16, torch.float32, "cpu")
    cache.normal_()
    q = torch.randn(meta.num_tokens, 4, 16)
    return q, cache[0].contiguous(), meta


def test_opcheck() -> None:
    q, cache, meta = _case()
    args = (q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_reqs, meta.max_query_len,
            0.25, -1, 0.0, 1)
    torch.library.opcheck(torch.ops.graphrunner.unified_attention.default, args)


def test_compile_keeps_attention_opaque() -> None:
    q, cache, meta = _case()
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(x: torch.Tensor) -> torch.Tensor:
        return unified_attention(x * 2.0, cache, meta, 0.25) + 1.0

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(q), step(q))
    assert sum("graphrunner.unified_attention" in s for s in seen) == 1, seen
