"""ModelState: the runner's per-architecture partner, and the only place it asks about one.

Built once per engine and held by the runner (and handed to capture), a ModelState builds the
model, turns a step's device inputs into attention metadata (`prepare_attn`, used by eager,
PIECEWISE, FULL and capture alike), declares the capture shapes and the dummy inputs for warm-up
and capture, and offers hooks for what the model returns besides hidden states and for per-request
state at admission. One subclass per architecture (model_states/<arch>.py) says what differs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphrunner.attention import AttentionMetadata
from graphrunner.config import ModelConfig
from graphrunner.input_prep import StepBuffers, StepInputs
from graphrunner.request import Request
from graphrunner.step_plan import StepShape

# Largest decode batch captured as a full graph and largest piecewise token bucket by default.
MAX_CAPTURE_BATCH_SIZE = 512
# FULL decode batch sizes, (start, step): every size costs ~40 ms of capture at start-up, while each padded row
# costs ~0.2% of a step at batch ~200 (steps of 32 there cost T1 at 200 requests 3-5%: docs/DECISIONS.md, S1)
DECODE_SIZE_STEPS = ((8, 8), (64, 16), (256, 32))
MIXED_BATCH_SIZES = (1, 2, 4, 8)
# 2, 4 and 8: a step of at most 8 tokens (a prefix-cache hit's short suffix, a chunked prompt's tail) takes a
# mixed graph of the size the piecewise buckets pad it to, which keeps its linears on the small-M GEMV
MIXED_TOKEN_BUCKETS = (2, 4, 8, 64, 128, 256, 512)
# Piecewise token buckets up to 256: the small-M GEMV's sizes (1-8) exactly, then steps of at most 2x
PIECEWISE_SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MAX_TOKEN_BUCKET = 2048  # larger steps are compute-bound: they run compiled, without graphs


@dataclass
class ModelOutput:
    """What one forward returns: the final hidden states (after the final norm: the LM head's input, and the
    features an EAGLE-1 head drafts from, as vLLM feeds them), plus any the architecture exposes for drafting."""

    hidden: torch.Tensor                                        # [T, hidden]
    aux_hidden: list[torch.Tensor] = field(default_factory=list)  # e.g. EAGLE-3's chosen layers, [T, hidden] each


class ModelState(ABC):
    """Per-architecture decisions for one engine.

        state = get_model_state(cfg.architecture)(cfg, block_size=16)
        model = graphrunner.loader.load_model(model_dir, state, dtype, device)

    `hf_config` (the parsed config.json) defaults to `config.hf`; it is read only for fields
    ModelConfig lacks (Llama's `mlp_bias`, Qwen's `layer_types` / `max_window_layers`).
    """

    def __init__(self, config: ModelConfig, hf_config: Mapping[str, Any] | None = None, *, block_size: int = 16,
                 num_speculative_tokens: int = 0) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.config = config
        self.hf_config: Mapping[str, Any] = dict(hf_config if hf_config is not None else config.hf)
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens

    # ---- model construction -------------------------------------------------------------------

    @abstractmethod
    def model_class(self) -> type[nn.Module]:
        """The nn.Module class to build; its constructor takes (config, **self.model_kwargs())."""

    def model_kwargs(self) -> dict[str, Any]:
        """Constructor keyword arguments besides the config (attention scale, per-layer windows, ...)."""
        return {
            "scale": self.attention_scale,
            "sliding_windows": [self.sliding_window(i) for i in range(self.config.num_layers)],
        }

    def build_model(self, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The model in eval mode without grads, parameters in `dtype` on `device`, weights NOT loaded
        (built on the meta device, then materialised; computed buffers such as rope tables are filled
        by each module's `reset_buffers()`)."""
        with torch.device("meta"):
            model = self.model_class()(self.config, **self.model_kwargs())
        target = torch.device(device)
        # nn.Module.to_empty, but through torch.empty: to_empty's empty_like of a meta tensor runs torch's Python
        # reference, which imports sympy (seconds of an uncompiled engine's start-up)
        model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=target))
        for module in model.modules():
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()
        return model.eval().requires_grad_(False)

    def forward(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> ModelOutput:
        """One forward over a step's tokens; an architecture returning more (hidden states for an EAGLE
        head) overrides this."""
        return ModelOutput(model(input_ids, positions))

    # ---- attention ----------------------------------------------------------------------------

    @property
    def attention_scale(self) -> float:
        """Softmax scale applied to q.k (1/sqrt(head_dim) unless an architecture says otherwise)."""
        return self.config.head_dim ** -0.5

    def sliding_window(self, layer_idx: int) -> int | None:
        """Sliding window of one layer; None = full attention. Full on every layer unless the
        architecture's own file says otherwise."""
        return None

    def prepare_attn(self, inputs: StepInputs, shape: StepShape) -> AttentionMetadata:
        """The attention metadata of one forward from its prepared device inputs and host counts."""
        cache = {} if shape.num_splits is None else {"num_splits": shape.num_splits}
        return AttentionMetadata(
            num_reqs=shape.num_reqs, num_tokens=shape.num_tokens, max_query_len=max(shape.query_lens, default=0),
            max_seq_len=max(shape.seq_lens, default=0), block_size=self.block_size,
            query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping, query_lens_cpu=list(shape.query_lens),
            seq_lens_cpu=list(shape.seq_lens), backend_cache=cache)

    # ---- capture shapes -----------------------------------------------------------------------

    @property
    def uniform_query_len(self) -> int:
        """Tokens per request in a uniform decode (FULL) step: 1 plus the draft tokens being verified."""
        return 1 + self.num_speculative_tokens

    @property
    def full_query_lens(self) -> tuple[int, ...]:
        """Tokens per request of the FULL graphs: plain decodes, and with speculation also verify steps."""
        return (1,) if self.num_speculative_tokens == 0 else (1, 1 + self.num_speculative_tokens)

    def decode_batch_sizes(self, max_num_seqs: int, requested: tuple[int, ...] | None = None) -> list[int]:
        """Batch sizes captured as full decode graphs, up to min(max_num_seqs, MAX_CAPTURE_BATCH_SIZE): by default
        1, 2, 4, then steps of 8 to 64, 16 to 256 and 32 beyond (DECODE_SIZE_STEPS), the limit always included;
        `requested` (compilation_config's cudagraph_capture_sizes) replaces them, sizes over the limit dropped."""
        limit = min(max_num_seqs, MAX_CAPTURE_BATCH_SIZE)
        if requested is not None:
            return sorted({s for s in requested if s <= limit})
        sizes = [1, 2, 4]
        for (start, step), end in zip(DECODE_SIZE_STEPS, [*(s for s, _ in DECODE_SIZE_STEPS[1:]), limit]):
            sizes += range(start, end, step)
        sizes = [s for s in sizes if s <= limit]
        if sizes[-1] != limit:
            sizes.append(limit)
        return sizes

    def mixed_full_sizes(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
        """(batch size, tokens) of the mixed FULL graphs: small batches with a short prefill chunk, the
        latency-bound case (a new request's prompt, a prefix-cache hit's suffix, beside a few decodes).
        Larger steps are worth their piecewise launches."""
        return [(p, t) for p in MIXED_BATCH_SIZES if p <= max_num_seqs
                for t in MIXED_TOKEN_BUCKETS if p * self.uniform_query_len < t <= max_num_batched_tokens]

    def token_buckets(self, max_num_batched_tokens: int) -> list[int]:
        """Token counts captured as piecewise graphs: PIECEWISE_SMALL_BUCKETS, then powers of two, ending at
        min(max_num_batched_tokens, MAX_TOKEN_BUCKET), which is always included. Up to 256 tokens a linear reads
        its weights once whatever M is, so padding a step to a coarser bucket costs little, while every bucket
        costs one capture per piece at start-up (docs/DECISIONS.md, S1)."""
        limit = min(max_num_batched_tokens, MAX_TOKEN_BUCKET)
        sizes = list(PIECEWISE_SMALL_BUCKETS)
        p = 512
        while p <= limit:
            sizes.append(p)
            p *= 2
        sizes = [s for s in sizes if s <= limit]
        if sizes[-1] != limit:
            sizes.append(limit)
        return sizes

    def dummy_inputs(self, buffers: StepBuffers, num_tokens: int, prefill: bool = False
                     ) -> tuple[StepInputs, StepShape]:
        """Inputs for warm-up, capture and memory profiling, written into the step buffers (a compiled
        model then sees the same tensors it sees in every later step). No request owns them and no KV is
        written (slot -1); `prefill` makes them one request over all tokens (the profiling shape), else
        padding tokens of no request."""
        num_reqs = 1 if prefill else 0
        cols = -(-num_tokens // self.block_size) if prefill else 0
        inputs = buffers.views(num_reqs, num_tokens, cols)
        inputs.input_ids.zero_()
        torch.arange(num_tokens, out=inputs.positions)
        inputs.positions.remainder_(self.config.max_position_embeddings)
        inputs.slot_mapping.fill_(-1)
        inputs.block_table.zero_()
        if prefill:
            inputs.query_start_loc.copy_(torch.tensor([0, num_tokens], dtype=torch.int32))
            inputs.seq_lens.fill_(num_tokens)
            inputs.logits_indices.fill_(num_tokens - 1)
        lens = (num_tokens,) * num_reqs
        return inputs, StepShape(num_reqs, num_tokens, lens, lens)

    # ---- per-request state --------------------------------------------------------------------

    def add_request(self, row: int, request: Request) -> None:
        """Admission of a request into state-table `row`: an architecture with per-request state of its
        own (M-RoPE positions, prompt embeddings) stages it here. Nothing by default."""
