"""Sampling kernels: Gumbel-max with a stateless counter-based RNG (see gumbel.py).

Re-exports the public entry points so callers write `from graphrunner.sampling import sample`.
"""

from __future__ import annotations

from graphrunner.sampling.gumbel import gumbel_noise_ref, gumbel_noise_triton, sample, sample_ref, sample_triton

__all__ = ["gumbel_noise_ref", "gumbel_noise_triton", "sample", "sample_ref", "sample_triton"]
