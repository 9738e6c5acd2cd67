"""CUDA-graph capture, the piecewise torch.compile backend and precompiled artifacts.

Built so far: `capture.piecewise.PiecewiseBackend`, which splits the model's graph at every
attention op and compiles the pieces with Inductor (checked on CPU). Not built yet: CUDA-graph
capture per bucket, the FULL decode graphs, the capture manager and precompilation; every step
still runs eagerly.
"""
