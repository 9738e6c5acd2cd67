"""Speculative decoding building blocks that run on the device over the state table.

`ngram`: prompt-lookup (n-gram) draft proposer, a Triton kernel and its PyTorch reference.
"""
