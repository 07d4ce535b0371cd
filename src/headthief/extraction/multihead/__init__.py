"""Multi-head attention (paper, Section 7 and Appendix C): canonical form, and extraction methods."""

from .result import MultiHeadExtraction, head_distance, match_heads

__all__ = ["MultiHeadExtraction", "head_distance", "match_heads"]
