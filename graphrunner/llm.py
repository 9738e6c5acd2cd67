"""The offline Python API, with vLLM's names: `LLM(model=...).generate(prompts, sampling_params)`.

Prompts are strings, token-id lists, `{"prompt_token_ids": [...]}` / `{"prompt": ...}` dicts, or
lists of those; results come back in prompt order. `stream()` yields partial outputs as they grow.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from graphrunner.engine import Engine
from graphrunner.engine_args import build_engine_config
from graphrunner.outputs import RequestOutput
from graphrunner.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    """An engine over one local HF-format model directory (the shipped demo model by default)."""

    def __init__(
        self,
        model: str | Path | None = None,
        tokenizer: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = False,
        compile_cache: str | Path | None = None,
        device: str | torch.device | None = None,
        use_triton: bool | None = None,
        logprobs_mode: str = "raw_logprobs",
        attention_backend: str | None = None,
        cudagraph_mode: str = "full_and_piecewise",
    ) -> None:
        self.config = build_engine_config(
            model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_gpu_blocks_override,
            enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching, device=device,
            use_triton=use_triton, logprobs_mode=logprobs_mode, attention_backend=attention_backend,
            compile_cache=compile_cache, cudagraph_mode=cudagraph_mode,
        )
        self.engine = Engine(self.config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _submit(self, prompts: Prompt | Sequence[Prompt],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} sampling params for {len(plist)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(plist, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:  # all-or-nothing: a bad prompt in the batch leaves no request behind
                self.engine.abort_request(rid)
            raise
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order."""
        ids = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (cumulative) each time one of the requests gains tokens."""
        self._submit(prompts, sampling_params)
        while self.engine.has_unfinished():
            yield from self.engine.step()
