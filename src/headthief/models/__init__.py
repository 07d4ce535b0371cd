"""Target models: what headthief extracts from (and what the tests check against)."""

from .attention import AttentionHead, random_head

__all__ = ["AttentionHead", "random_head"]
