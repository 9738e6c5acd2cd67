"""ModelState: what the shared runner must not hard-code about an architecture.

One subclass per architecture (model_states/<arch>.py) names the model class and its extra
constructor arguments; this base supplies the attention needs (scale, per-layer sliding window),
the default capture shapes and the dummy inputs used for warm-up and CUDA-graph capture.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from graphrunner.config import ModelConfig

# Largest decode batch captured as a full graph and largest piecewise token bucket by default.
MAX_CAPTURE_BATCH_SIZE = 512
MAX_TOKEN_BUCKET = 2048  # larger steps are compute-bound: they run compiled, without graphs


class ModelState(ABC):
    """Per-architecture decisions, built from a ModelConfig plus (optionally) the raw HF config dict.

    Usage by the runner:
        state = get_model_state(cfg.architecture)(cfg, hf_config)   # hf_config: parsed config.json
        model = graphrunner.loader.load_model(model_dir, cfg, dtype, device, state=state)
    `load_model` calls `state.build_model(dtype, device)`, which returns the module with
    *uninitialised* weights (built on the meta device, then materialised with `to_empty`; computed
    buffers such as rope tables are filled by each module's `reset_buffers()`), and then loads the
    checkpoint into it. `hf_config` is needed only for fields ModelConfig lacks (Llama `mlp_bias`,
    Qwen `layer_types`/`max_window_layers`); without it those fall back to their HF defaults.
    """

    def __init__(self, config: ModelConfig, hf_config: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.hf_config: Mapping[str, Any] = dict(hf_config or {})

    @classmethod
    def from_config(cls, config: ModelConfig, hf_config: Mapping[str, Any] | None = None) -> ModelState:
        """Same as the constructor; kept as the named entry point."""
        return cls(config, hf_config)

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
        """The model in eval mode without grads, parameters in `dtype` on `device`, weights NOT loaded."""
        with torch.device("meta"):
            model = self.model_class()(self.config, **self.model_kwargs())
        model = model.to(dtype=dtype).to_empty(device=torch.device(device))
        for module in model.modules():
            reset = getattr(module, "reset_buffers", None)
            if callable(reset):
                reset()
        return model.eval().requires_grad_(False)

    # ---- attention needs ----------------------------------------------------------------------

    @property
    def attention_scale(self) -> float:
        """Softmax scale applied to q.k (1/sqrt(head_dim) for every supported architecture)."""
        return self.config.head_dim ** -0.5

    def sliding_window(self, layer_idx: int) -> int | None:
        """Sliding window of one layer (None = full attention), following HF's `layer_types`."""
        window = self.config.sliding_window
        if window is None:
            return None
        layer_types = self.hf_config.get("layer_types")
        if layer_types:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        max_window_layers = self.hf_config.get("max_window_layers")
        if max_window_layers is not None:
            return window if layer_idx >= max_window_layers else None
        return window

    # ---- capture shapes -----------------------------------------------------------------------

    def decode_batch_sizes(self, max_num_seqs: int) -> list[int]:
        """Batch sizes captured as full decode graphs: 1, 2, 4, 8, 16, 24, ... (step 8), ending at
        min(max_num_seqs, MAX_CAPTURE_BATCH_SIZE), which is always included."""
        limit = min(max_num_seqs, MAX_CAPTURE_BATCH_SIZE)
        sizes = [s for s in [1, 2, 4, *range(8, limit + 1, 8)] if s <= limit]
        if sizes[-1] != limit:
            sizes.append(limit)
        return sizes

    def token_buckets(self, max_num_batched_tokens: int) -> list[int]:
        """Token counts captured as piecewise graphs: the decode sizes up to 256, then powers of two,
        ending at min(max_num_batched_tokens, MAX_TOKEN_BUCKET), which is always included."""
        limit = min(max_num_batched_tokens, MAX_TOKEN_BUCKET)
        sizes = [1, 2, 4, *range(8, 257, 8)]
        p = 512
        while p <= limit:
            sizes.append(p)
            p *= 2
        sizes = [s for s in sizes if s <= limit]
        if sizes[-1] != limit:
            sizes.append(limit)
        return sizes

    def dummy_inputs(self, num_tokens: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Model inputs for warm-up/capture: call `model(**state.dummy_inputs(n, device))`."""
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)  # [T] int64
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)  # [T] int64
        positions = positions % self.config.max_position_embeddings
        return {"input_ids": input_ids, "positions": positions}
