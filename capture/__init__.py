"""CUDA-graph capture, the piecewise torch.compile backend and precompiled artifacts.

`piecewise.PiecewiseBackend` splits the model's graph at every attention op and compiles the pieces;
`cuda_piece` replays a graph per (piece, token bucket); `manager.CaptureManager` captures those and the
FULL decode graphs and dispatches each step; `compiled` compiles the engine's model (warm from a
precompiled directory, checked by `manifest`). Capture sits beside the runner and never imports it.
"""
