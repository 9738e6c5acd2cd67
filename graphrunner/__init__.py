"""graphrunner: a low-latency LLM runner for Hugging Face-format decoder models.

Public API (vLLM-compatible names): `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`.
"""

from graphrunner.llm import LLM
from graphrunner.outputs import CompletionOutput, RequestOutput
from graphrunner.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
