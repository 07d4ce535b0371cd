"""headthief: recover the parameters of attention heads from black-box queries.

Implements and extends Bhattamishra, Shah, Hahn, Kanade, "Provably Learning Attention with Queries"
(arXiv:2601.16873). One call runs an extraction as the command line does::

    import headthief as ht
    r = ht.extract("minilm:layer=2,head=5", method="lowrank")     # a Report: r.row, r.result, r.exit_code

``import headthief`` needs only numpy, scipy and rich; heavier frameworks are imported inside the
functions that need them.
"""

from .errors import (BudgetExceeded, ComputeLimit, ConvergenceError, HeadthiefError, InvalidQuery, ModelMismatch, NotIdentifiable,
                     OracleError, SpecError)
from .extraction import Extraction, Fidelity, exact_query_count, extract_exact
from .extraction import extract_membership, extract_membership_paper
from .extraction import extract_lowrank, extract_rop, lowrank_query_count, rop_query_count
from .extraction import extract_noisy, extract_noisy_paper
from .extraction.multihead import (MultiHeadExtraction, canonical_form, extract_multihead, extract_multihead_hessian,
                                   extract_multihead_subspaces, multihead_query_count, subspaces_query_count)
from .extraction.transformer import (TransformerExtraction, extract_transformer, extract_transformer_heads,
                                     extract_transformer_paper)
from .extraction.transformer.ffn import FFNExtraction, extract_ffn
from .models import AttentionHead, MultiHeadAttention, random_head, random_multihead
from .models.ffn import ReLUFFN, random_ffn
from .models.transformer import Transformer, random_transformer
from .oracles import CallableOracle, ModelOracle, Oracle, Transcript
from .pipeline import Options, Report, auto_method, extract
from .targets import Target, resolve
from .oracles import SignOnly
from .oracles import Tolerance

__version__ = "0.1.0"

__all__ = [
    "extract", "Report", "Options", "auto_method", "resolve", "Target",
    "AttentionHead", "random_head",
    "MultiHeadAttention", "random_multihead", "extract_multihead", "extract_multihead_subspaces",
    "extract_multihead_hessian", "MultiHeadExtraction", "canonical_form", "multihead_query_count",
    "subspaces_query_count",
    "ReLUFFN", "random_ffn", "extract_ffn", "FFNExtraction",
    "Transformer", "random_transformer", "extract_transformer", "extract_transformer_paper",
    "extract_transformer_heads", "TransformerExtraction",
    "Oracle", "ModelOracle", "CallableOracle", "Transcript",
    "extract_exact", "exact_query_count", "Extraction", "Fidelity",
    "SignOnly", "extract_membership", "extract_membership_paper",
    "extract_lowrank", "lowrank_query_count", "extract_rop", "rop_query_count",
    "Tolerance", "extract_noisy", "extract_noisy_paper",
    "HeadthiefError", "BudgetExceeded", "ComputeLimit", "NotIdentifiable", "InvalidQuery", "OracleError",
    "ConvergenceError", "SpecError", "ModelMismatch",
]
