"""Extraction algorithms: functions of an oracle that return a frozen :class:`Extraction`."""

from .exact import exact_query_count, extract_exact
from .result import Extraction, Fidelity, direction_err, rel_err

__all__ = ["extract_exact", "exact_query_count", "Extraction", "Fidelity", "rel_err", "direction_err"]
