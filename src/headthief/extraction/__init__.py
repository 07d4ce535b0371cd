"""Extraction algorithms: functions of an oracle that return a frozen :class:`Extraction`."""

from .exact import exact_query_count, extract_exact
from .lowrank import extract_lowrank, lowrank_query_count
from .rop import extract_rop, rop_query_count
from .membership import extract_membership
from .membership_paper import extract_membership_paper
from .noisy import extract_noisy, noisy_query_count
from .noisy_paper import extract_noisy_paper, noisy_paper_query_count, theorem_tolerance
from .result import Extraction, Fidelity, direction_err, rel_err

__all__ = ["extract_exact", "exact_query_count", "extract_membership", "extract_membership_paper", "Extraction", "Fidelity", "rel_err", "direction_err",
           "extract_lowrank", "lowrank_query_count", "extract_rop", "rop_query_count",
           "extract_noisy", "noisy_query_count", "extract_noisy_paper", "noisy_paper_query_count", "theorem_tolerance"]
