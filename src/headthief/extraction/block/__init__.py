"""The block method: a whole post-LN BERT encoder block from vector answers at every position.

Stages built so far (each exact up to the block's symmetries and the answers' precision):

* :mod:`.layernorm` (stage L): the output LayerNorm's gamma_2, beta_2 from the answers' ellipsoid;
* :mod:`.value_sum` (stage V): ``B = I + sum_h O_h V_h`` and ``b`` (mod the ones-vector) from
  finite-difference Jacobians of one- and two-token answers;
* :mod:`.smoothness`: the activation check (GELU is smooth; a ReLU's kinks are a ModelMismatch);
* :mod:`.embeddings` (the encoder's stage E): LN_emb and the position offsets from ``hidden_states[0]``,
  and inputs_embeds that put any wanted point of LN_emb's image into block 0.

See ``docs/block.md`` for the plan of the remaining stages (heads, FFN) and what is measured.
"""

from .embeddings import Embeddings, embedding_stage
from .layernorm import OutputLayerNorm, fit_output_layernorm
from .smoothness import Smoothness, check_smooth_activation
from .value_sum import ValueSum, centre, value_sum

__all__ = ["Embeddings", "OutputLayerNorm", "embedding_stage", "Smoothness", "ValueSum", "centre", "check_smooth_activation", "fit_output_layernorm",
           "value_sum"]
