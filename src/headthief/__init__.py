"""headthief: recover the parameters of attention heads from black-box queries.

Implements and extends Bhattamishra, Shah, Hahn, Kanade, "Provably Learning Attention with Queries"
(arXiv:2601.16873). ``import headthief`` needs only numpy and scipy; heavier frameworks are imported
inside the functions that need them.
"""

from .errors import (BudgetExceeded, ConvergenceError, HeadthiefError, InvalidQuery, ModelMismatch, NotIdentifiable,
                     OracleError, SpecError)
from .extraction import Extraction, Fidelity, exact_query_count, extract_exact
from .extraction import extract_membership, extract_membership_paper
from .extraction import extract_lowrank, extract_rop, lowrank_query_count, rop_query_count
from .extraction import extract_noisy, extract_noisy_paper
from .models import AttentionHead, random_head
from .oracles import CallableOracle, ModelOracle, Oracle, Transcript
from .oracles import SignOnly
from .oracles import Tolerance

__version__ = "0.1.0"

__all__ = [
    "AttentionHead", "random_head",
    "Oracle", "ModelOracle", "CallableOracle", "Transcript",
    "extract_exact", "exact_query_count", "Extraction", "Fidelity",
    "SignOnly", "extract_membership", "extract_membership_paper",
    "extract_lowrank", "lowrank_query_count", "extract_rop", "rop_query_count",
    "Tolerance", "extract_noisy", "extract_noisy_paper",
    "HeadthiefError", "BudgetExceeded", "NotIdentifiable", "InvalidQuery", "OracleError",
    "ConvergenceError", "SpecError", "ModelMismatch",
]
