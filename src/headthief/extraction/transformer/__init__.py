"""One-layer transformers (Section 4.1) and the FFN learner they need.

Modules add their public names here as they land; import them from their modules
(``from headthief.extraction.transformer.ffn import extract_ffn``).
"""

# the one-layer transformer methods (issue 10: the paper's reduction, the through-FFN method, verification)
from .paper import extract_transformer_heads, extract_transformer_paper, paper_attention_query_count  # noqa: E402
from .recovered import TransformerExtraction, kink_sequences, verify_transformer  # noqa: E402
from .through_ffn import extract_transformer, through_ffn_query_count  # noqa: E402
