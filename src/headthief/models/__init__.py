"""Target models: what headthief extracts from (and what the tests check against)."""

from .attention import AttentionHead, random_head
from .multihead import MultiHeadAttention, random_multihead

__all__ = ["AttentionHead", "random_head", "MultiHeadAttention", "random_multihead"]
