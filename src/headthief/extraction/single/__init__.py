"""Single-head extraction from exact value answers: Theorem 4.1 (exact) and Theorem 5.1 (low rank)."""

from .exact import exact_query_count, extract_exact
from .lowrank import extract_lowrank, lowrank_query_count
from .rop import extract_rop, rop_query_count

__all__ = ["extract_exact", "exact_query_count", "extract_lowrank", "lowrank_query_count", "extract_rop",
           "rop_query_count"]
