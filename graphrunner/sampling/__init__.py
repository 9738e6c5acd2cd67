"""Sampling on the device: masks and bias, penalties, temperature, min-p/top-k/top-p, Gumbel-max
with a stateless counter-based RNG, and logprobs. `run_sampler` (sampler.py) runs the pipeline;
each stage module holds its Triton kernel next to its PyTorch reference.
"""

from __future__ import annotations

from graphrunner.sampling.gumbel import gumbel_noise_ref, gumbel_noise_triton, sample_ref
from graphrunner.sampling.gumbel_split import sample, sample_triton

__all__ = ["gumbel_noise_ref", "gumbel_noise_triton", "sample", "sample_ref", "sample_triton"]
