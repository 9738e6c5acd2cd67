"""Paged attention: metadata, the forward context, the attention layer and its PyTorch reference."""

from graphrunner.attention.context import ForwardContext, forward_context, get_forward_context
from graphrunner.attention.layer import Attention
from graphrunner.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "ForwardContext", "forward_context", "get_forward_context"]
