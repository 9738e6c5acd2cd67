"""The Triton attention as a torch custom op: opcheck passes, and torch.compile keeps it opaque
(one node in the captured graph) while the compiled function equals eager execution.
"""

from __future__ import annotations

import torch

from graphrunner.attention.testing import contiguous_batch
from graphrunner.attention.triton_attention import unified_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (Triton's CPU interpreter is off on a CUDA machine)


def _case() -> tuple:
    torch.manual_seed(0)
    meta, cache = contiguous_batch([1, 5, 2], [3, 5, 20], 1, 2, 16, 16, torch.float32, DEVICE)
    cache.normal_()
    q = torch.randn(meta.num_tokens, 4, 16, device=DEVICE)
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


def test_whole_model_compiles_with_one_opaque_attention_per_layer(tmp_path: object) -> None:
    from pathlib import Path

    from tiny_models import make_tiny_model, model_state_for

    from graphrunner.attention import forward_context
    from graphrunner.config import ModelConfig
    from graphrunner.loader import load_model

    model_dir = make_tiny_model(Path(str(tmp_path)), "Qwen3ForCausalLM")
    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, model_state_for(model_dir), torch.float32, torch.device("cpu"))
    graphs: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for lens in ([5, 3], [1, 1, 7]):  # two steps with different shapes and metadata
        ids = torch.arange(sum(lens)) % cfg.vocab_size
        pos = torch.cat([torch.arange(n) for n in lens])
        outs = []
        for fn in (model, compiled):
            meta, kv = contiguous_batch(lens, lens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16,
                                        torch.float32, "cpu")
            with torch.inference_mode(), forward_context(meta, kv):
                outs.append(fn(ids, pos))
        torch.testing.assert_close(outs[1], outs[0])
    assert len(graphs) == 1, "metadata lives in the forward context: a new step must not recompile"
    assert sum("graphrunner.paged_attention" in t for t in graphs[0]) == cfg.num_layers
