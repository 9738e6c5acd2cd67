"""CUDA-graph capture, the piecewise torch.compile backend and precompiled artifacts.

Built so far: `piecewise.PiecewiseBackend` (the model's graph split at every attention op, pieces
compiled by Inductor), `compiled` (compiling the engine's model from a precompiled directory, and
`graphrunner precompile`), `manifest` (refusing a cache built for another setup). Checked on CPU.
Not built yet: CUDA-graph capture per bucket, FULL decode graphs and the capture manager; without
a compile cache every step runs eagerly.
"""
