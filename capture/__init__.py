"""CUDA-graph capture, the piecewise torch.compile backend and precompiled artifacts.

Empty until the capture work lands: every step runs eagerly for now (see README, "Status").
"""
