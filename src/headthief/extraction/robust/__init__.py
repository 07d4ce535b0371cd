"""Single-head extraction from degraded answers: noisy (Theorem 6.1) and sign-only (Appendix B)."""

from .membership import extract_membership
from .membership_paper import extract_membership_paper
from .noisy import extract_noisy, noisy_query_count
from .noisy_paper import extract_noisy_paper, noisy_paper_query_count, theorem_tolerance

__all__ = ["extract_membership", "extract_membership_paper", "extract_noisy", "noisy_query_count",
           "extract_noisy_paper", "noisy_paper_query_count", "theorem_tolerance"]
