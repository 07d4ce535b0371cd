"""Extraction algorithms: functions of an oracle that return a frozen :class:`Extraction`."""

from .single import exact_query_count, extract_exact, extract_lowrank, extract_rop, lowrank_query_count, rop_query_count
from .robust import (extract_membership, extract_membership_paper, extract_noisy, extract_noisy_paper, noisy_paper_query_count,
                     noisy_query_count, theorem_tolerance)
from .result import Extraction, Fidelity, direction_err, rel_err

__all__ = ["extract_exact", "exact_query_count", "extract_membership", "extract_membership_paper", "Extraction", "Fidelity", "rel_err", "direction_err",
           "extract_lowrank", "lowrank_query_count", "extract_rop", "rop_query_count",
           "extract_noisy", "noisy_query_count", "extract_noisy_paper", "noisy_paper_query_count", "theorem_tolerance"]
