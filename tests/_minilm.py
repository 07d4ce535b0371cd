"""Shared by the MiniLM tests: a layer's tensors read independently of headthief."""

import numpy as np

from headthief.models import minilm


def raw_layer(layer):
    """The layer's tensors, read independently of headthief (whole file, safetensors.numpy), float64."""
    from safetensors.numpy import load_file
    t = load_file(str(minilm.minilm_weights_path()))
    pre = f"encoder.layer.{layer}.attention."
    return {k: t[pre + n].astype(np.float64) for k, n in [
        ("q", "self.query.weight"), ("bq", "self.query.bias"), ("k", "self.key.weight"), ("bk", "self.key.bias"),
        ("v", "self.value.weight"), ("bv", "self.value.bias"), ("o", "output.dense.weight"),
        ("bo", "output.dense.bias")]}
