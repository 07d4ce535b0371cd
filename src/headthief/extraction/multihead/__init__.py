"""Multi-head attention (paper, Section 7 and Appendix C): canonical form, and extraction methods.

Every method here runs through the model check (:func:`headthief.extraction.check.checked`) for the
multi-head class: one-token affinity, key order and repetition hold for any number of heads.
"""

from ..check import MULTI, checked
from . import hessian as _hessian
from . import isolation as _isolation
from . import subspaces as _subspaces
from .canonical import canonical_form, equivalent_parameters
from .isolation import multihead_query_count
from .result import MultiHeadExtraction, head_distance, match_heads
from .subspaces import subspaces_query_count

extract_multihead = checked(MULTI)(_isolation.extract_multihead)
extract_multihead_subspaces = checked(MULTI)(_subspaces.extract_multihead_subspaces)
extract_multihead_hessian = checked(MULTI)(_hessian.extract_multihead_hessian)

__all__ = ["MultiHeadExtraction", "head_distance", "match_heads", "canonical_form", "equivalent_parameters",
           "extract_multihead", "multihead_query_count", "extract_multihead_subspaces", "subspaces_query_count",
           "extract_multihead_hessian"]
