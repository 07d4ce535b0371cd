"""The smooth activations an FFN block may use, each with the two derivatives the block method reads.

BERT's own activation is the exact GELU ``s Phi(s)``. Other encoders use another smooth gate of the same
shape ``s g(s)`` with ``g`` a sigmoid-like step, ``g(-s) = 1 - g(s)``:

======================  =====================  ==============================================================
headthief name          transformers' names    f(s)
======================  =====================  ==============================================================
``gelu``                ``gelu``               ``s Phi(s) = s (1 + erf(s / sqrt 2)) / 2`` (BERT, RoBERTa, MiniLM)
``gelu_tanh``           ``gelu_new``,          ``s (1 + tanh(sqrt(2/pi) (s + 0.044715 s^3))) / 2`` (GPT-2,
                        ``gelu_pytorch_tanh``  ALBERT); ``gelu_fast`` is the same function written another way
``silu``                ``silu``, ``swish``    ``s sigma(s)``
``quick_gelu``          ``quick_gelu``         ``s sigma(1.702 s)`` (CLIP)
======================  =====================  ==============================================================

Each :class:`Activation` gives ``f`` (in the argument's dtype, as a float32 model computes it), ``prime`` and
``second`` (float64; stage F fits every neuron's ``f'`` profile, with ``f''`` as its Jacobian), and ``torch``
(the refits on a torch device). The block method assumes one of them (``--activation``, default ``gelu``)
and refuses a block whose answers another explains (a :class:`~headthief.errors.ModelMismatch`): the
functions differ by 1e-4 - 1e-2 of their range, far above what float64 answers resolve, and above float32's
noise once the refits have fitted it (measured in ``docs/block.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715
_Q = 1.702


def _erf(s):
    from scipy.special import erf
    return erf(s)


def _expit(s):
    from scipy.special import expit
    return expit(s)


def gelu(s: np.ndarray) -> np.ndarray:
    """Exact GELU ``s * Phi(s)`` (erf form, BERT's ``"gelu"``), evaluated in ``s``'s dtype."""
    s = np.asarray(s)
    dt = s.dtype.type
    return s * (dt(0.5) * (dt(1.0) + _erf(s * dt(1.0 / np.sqrt(2.0)))))


def gelu_prime(s: np.ndarray) -> np.ndarray:
    """GELU's derivative ``Phi(s) + s phi(s)`` (float64)."""
    s = np.asarray(s, dtype=np.float64)
    return 0.5 * (1.0 + _erf(s / np.sqrt(2.0))) + s * np.exp(-0.5 * s * s) / np.sqrt(2.0 * np.pi)


def _gelu_second(s):
    s = np.asarray(s, dtype=np.float64)
    return np.exp(-0.5 * s * s) * (2.0 - s * s) / np.sqrt(2.0 * np.pi)


def gelu_tanh(s: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (transformers' ``"gelu_new"`` / ``"gelu_pytorch_tanh"``, GPT-2's), in
    ``s``'s dtype: within ~3e-4 of :func:`gelu`, another activation all the same."""
    s = np.asarray(s)
    dt = s.dtype.type
    return dt(0.5) * s * (dt(1.0) + np.tanh(dt(_C) * (s + dt(_A) * s * s * s)))


def _tanh_parts(s):
    s = np.asarray(s, dtype=np.float64)
    s2 = s * s                          # not s ** 3: numpy's general power, 100x slower (measured, 720,000 entries)
    t = np.tanh(_C * (s + _A * s2 * s))
    return s, t, _C * (1.0 + 3.0 * _A * s2)


def _gelu_tanh_both(s):
    """``(f(s), f'(s))`` of GELU's tanh form in float64, one tanh for both."""
    s, t, du = _tanh_parts(s)
    return 0.5 * s * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * du


def _gelu_tanh_prime(s):
    return _gelu_tanh_both(s)[1]


def _gelu_tanh_second(s):
    s, t, du = _tanh_parts(s)
    return (1.0 - t * t) * (du + 0.5 * s * (6.0 * _A * _C * s - 2.0 * t * du * du))


def _sigmoid_gate(k: float):
    """``f(s) = s sigma(k s)`` (k = 1: SiLU; 1.702: quick GELU), its two derivatives, and ``(f, f')`` in
    float64 with one sigmoid for both."""
    def f(s):
        s = np.asarray(s)
        return s * _expit(s * s.dtype.type(k))

    def both(s):
        s = np.asarray(s, dtype=np.float64)
        g = _expit(k * s)
        return s * g, g + k * s * g * (1.0 - g)

    def prime(s):
        return both(s)[1]

    def second(s):
        s = np.asarray(s, dtype=np.float64)
        g = _expit(k * s)
        return k * g * (1.0 - g) * (2.0 + k * s * (1.0 - 2.0 * g))
    return f, prime, second, both


def _torch_gelu(s):
    return 0.5 * s * (1.0 + (s * (1.0 / math.sqrt(2.0))).erf())


def _torch_gelu_tanh(s):
    return 0.5 * s * (1.0 + (_C * (s + _A * s * s * s)).tanh())


@dataclass(frozen=True)
class Activation:
    """One smooth activation: ``f`` (argument's dtype), ``prime``, ``second`` (float64), ``torch``, and
    ``hf``: the ``hidden_act`` that transformers' ``BertLayer`` takes for it."""

    name: str
    hf: str
    formula: str
    f: Callable[[np.ndarray], np.ndarray]
    prime: Callable[[np.ndarray], np.ndarray]
    second: Callable[[np.ndarray], np.ndarray]
    torch: Callable


_silu = _sigmoid_gate(1.0)
_quick = _sigmoid_gate(_Q)
SMOOTH: dict[str, Activation] = {
    "gelu": Activation("gelu", "gelu", "s Phi(s) (erf)", gelu, gelu_prime, _gelu_second, _torch_gelu),
    "gelu_tanh": Activation("gelu_tanh", "gelu_new", "s (1 + tanh(sqrt(2/pi) (s + 0.044715 s^3))) / 2", gelu_tanh,
                            _gelu_tanh_prime, _gelu_tanh_second, _torch_gelu_tanh),
    "silu": Activation("silu", "silu", "s sigma(s)", *_silu[:3], lambda s: s * s.sigmoid()),
    "quick_gelu": Activation("quick_gelu", "quick_gelu", "s sigma(1.702 s)", *_quick[:3],
                             lambda s: s * (_Q * s).sigmoid()),
}
_BOTH = {"gelu_tanh": _gelu_tanh_both, "silu": _silu[3], "quick_gelu": _quick[3]}   # value_and_prime's fused pairs


def activation(name: str) -> Activation:
    """The smooth activation ``name`` (one of :data:`SMOOTH`); anything else is a :class:`ValueError` that
    lists them."""
    try:
        return SMOOTH[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {name!r}: the block method reads one of {', '.join(SMOOTH)} "
                         "(a piecewise-linear one such as ReLU has no smooth profile to fit)") from None


def value_and_prime(name: str, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(f(s), f'(s))`` in float64 for the refits' losses (GELU's ``Phi``, its tanh form's tanh, a sigmoid
    gate's sigmoid: computed once for both)."""
    if name == "gelu":
        Phi = 0.5 * (1.0 + _erf(s * (1.0 / np.sqrt(2.0))))
        return s * Phi, Phi + s * np.exp(-0.5 * s * s) * (1.0 / np.sqrt(2.0 * np.pi))
    if name in _BOTH:
        return _BOTH[name](s)
    a = activation(name)
    return a.f(s), a.prime(s)


__all__ = ["Activation", "SMOOTH", "activation", "gelu", "gelu_prime", "gelu_tanh", "value_and_prime"]
