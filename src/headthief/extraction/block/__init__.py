"""The block method: a whole post-LN BERT encoder block from vector answers at every position.

Stages built so far (each exact up to the block's symmetries and the answers' precision):

* :mod:`.layernorm` (stage L): the output LayerNorm's gamma_2, beta_2 from the answers' ellipsoid;
* :mod:`.value_sum` (stage V): ``B = I + sum_h O_h V_h`` and ``b`` (mod the ones-vector) from
  finite-difference Jacobians of one- and two-token answers;
* :mod:`.arithmetic`: the floating-point operations the stages after V plan (``--max-tflop``);
* :mod:`.smoothness`: the activation check (GELU is smooth; a ReLU's kinks are a ModelMismatch);
* :mod:`.ffn` (stage F): LN1 and the GELU FFN (every neuron) from the span of finite-difference
  Jacobians on LN1's sphere, once stages L and V make LN1's output choosable; checked on fresh one-token queries;
* :mod:`.ffn_probes` (stage F, large d): the same from Jacobians along a few probe directions and, at points
  inside the probes' span, every other direction (a quarter of the queries or fewer from d = 64);
* :mod:`.heads` (stage A): every head's ``P O_h``, ``W_h``, ``c_h`` from second-order reads at equal tokens;
* :mod:`.one_token_refit`, :mod:`.block_refit` (coarse answers, float32): the algebra's parts refitted by
  L-BFGS to answers of random tokens and sequences;
* :mod:`.extract`: ``--method block``, the stages in order, the assembled block and its model check;
* :mod:`.embeddings` (the encoder's stage E): LN_emb and the position offsets from ``hidden_states[0]``,
  and inputs_embeds that put any wanted point of LN_emb's image into block 0;
* on the previous LayerNorm's image only (a block inside an encoder, ``bert-block:...,inputs=image``):
  :mod:`.image` (the image, its great circles, a guard refusing other tokens), :mod:`.value_sum_image`
  (stage V from great-circle Jacobians), :mod:`.ffn_image` (stage F through ``dm/dn``) and
  :mod:`.on_image` (the whole block: those stages, then the heads fitted to answers of image sequences).

* :mod:`.encoder` (``--method encoder``): a whole encoder answering every layer's hidden states, block by
  block from forward paths (each block's inputs observed, never inverted), d <= 88;
* :mod:`.encoder_parts`: what an encoder API gives away without a block taken apart (``hidden=last``, or
  d > 88): the position offsets from LN_emb's scale invariance, the output LayerNorms, a permutation check.

Not reached at MiniLM's size (d = 384): stage V reads MiniLM's float32 blocks, but the stages after it plan
thousands of TFLOP (:mod:`.arithmetic`), so such a run stops after stage V (``--max-tflop``); stage A's reads
are not reduced. See ``docs/block.md``.
"""

from .embeddings import Embeddings, embedding_stage
from .extract import BlockExtraction, extract_block
from .heads import Heads, extract_heads
from .ffn import FFNPart, check_one_token, extract_ffn, predict_one_token
from .ffn_probes import extract_ffn_probes
from .image import ImageGuard, LayerNormImage
from .layernorm import OutputLayerNorm, fit_output_layernorm
from .on_image import ImageBlockExtraction, extract_block_on_image
from .smoothness import Smoothness, check_smooth_activation
from .value_sum import ValueSum, centre, value_sum

__all__ = ["BlockExtraction", "Embeddings", "Heads", "ImageBlockExtraction", "ImageGuard", "LayerNormImage",
           "extract_block", "extract_block_on_image", "extract_heads", "FFNPart", "OutputLayerNorm", "check_one_token",
           "embedding_stage", "extract_ffn", "extract_ffn_probes", "predict_one_token", "Smoothness", "ValueSum",
           "centre", "check_smooth_activation", "fit_output_layernorm", "value_sum"]
