"""Per-architecture ModelState classes: the abstract base and a lazy registry keyed by HF architecture.

`get_model_state(cfg.architecture)(cfg, hf_config)` is the runner's entry point.
"""

from model_states.base import ModelState
from model_states.registry import get_model_state, supported_architectures

__all__ = ["ModelState", "get_model_state", "supported_architectures"]
