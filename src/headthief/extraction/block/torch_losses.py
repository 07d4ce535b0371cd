"""The block method's two refits on a torch device (``--refit-device cuda``): the same losses, on a GPU.

At MiniLM's size the one-token refit F+ and the block refit R are most of the block method's arithmetic
(3,980 of 4,268 planned TFLOP, :mod:`.arithmetic`), hours to days of numpy on a 2-core CPU. Their losses are
a few dense products per evaluation, which a GPU runs in float64 hundreds of times faster. The classes here
compute exactly the sums of squares of :func:`.block_refit.loss_and_grad` and
:func:`.one_token_refit.loss_and_grad` (the same forward pass: softmax attention with ``b_K = b_V = 0``,
LayerNorm without eps, the erf GELU; float64), their gradients by torch's autograd, with the answers moved to
the device once. The optimiser (scipy's L-BFGS, :func:`.lbfgs.minimize_in_chunks`) stays on the CPU: one
evaluation moves the parameter vector there and the gradient back (1.8 million numbers at MiniLM's size).
Tested against the numpy gradients on the CPU device (``cpu``); what a GPU gains is measured where one is
lent (``benchmarks/bench_block_refit_numpy.py --device``).
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import SpecError
from .lbfgs import LEPS_RANGE, unpack

DEVICES = "numpy (default), cpu (torch on the CPU), cuda or cuda:N"


def check_device(device: str | None) -> str | None:
    """``None`` for numpy, else the torch device name; :class:`SpecError` naming what is wrong (unknown name,
    no torch, no CUDA device) before any query is sent."""
    if device in (None, "numpy"):
        return None
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or
                                           (device.startswith("cuda:") and device[5:].isdigit())):
        raise SpecError(f"--refit-device must be {DEVICES}, got {device!r}")
    try:
        import torch
    except ImportError:
        raise SpecError(f"--refit-device {device} needs torch (the torch extra: pip install -e '.[torch]')") from None
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SpecError(f"--refit-device {device}: torch sees no CUDA device on this machine")
        index = int(device[5:]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise SpecError(f"--refit-device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _normalize(v, eps=0.0):
    c = v - v.mean(dim=-1, keepdim=True)
    return c / (c.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()


def _act(name: str):
    from ...models.activations import activation
    return activation(name).torch


class _Loss:
    """Parameters unpacked from theta onto the device, a forward pass, autograd; answers kept on the device."""

    def __init__(self, shapes: dict, device: str):
        import torch
        self.torch, self.shapes, self.device = torch, dict(shapes), torch.device(device)

    def tensor(self, a):
        return self.torch.tensor(np.asarray(a, dtype=np.float64), device=self.device)    # a copy: frozen arrays too

    def run(self, theta: np.ndarray, loss_of) -> tuple[float, np.ndarray]:
        t = self.tensor(theta).requires_grad_(True)
        L = loss_of(unpack(t, self.shapes))             # views of the one tensor autograd differentiates
        (g,) = self.torch.autograd.grad(L, t)
        return float(L.detach().cpu()), g.detach().cpu().numpy()


class BlockLoss(_Loss):
    """``(theta, shift=None) -> (loss, gradient)`` of :func:`.block_refit.loss_and_grad` on ``device``;
    ``shift``: arrays subtracted from each group's answers (the Gauss-Newton diagonal's random signs)."""

    def __init__(self, shapes: dict, groups, fixed: dict, device: str, activation: str = "gelu"):
        super().__init__(shapes, device)
        self.act = _act(activation)
        self.groups = [(self.tensor(X), self.tensor(Y)) for X, Y in groups]
        self.fixed = {k: self.tensor(v) for k, v in (fixed or {}).items()}

    def __call__(self, theta: np.ndarray, shift=None) -> tuple[float, np.ndarray]:
        def loss_of(p):
            p = {**self.fixed, **p}
            total = 0.0
            for i, (X, Y) in enumerate(self.groups):
                target = Y if shift is None else Y - self.tensor(shift[i])
                total = total + self._group(p, X, target)
            return total
        return self.run(theta, loss_of)

    def _group(self, p, X, Y):
        H, dh, d = p["Q"].shape
        N, T = X.shape[:2]
        Xf = X.reshape(N * T, d)

        def heads(M):
            return (Xf @ M.reshape(H * dh, d).T).reshape(N, T, H, dh).transpose(1, 2)

        v = heads(p["V"])
        if T == 1:
            z = v
        else:
            q = heads(p["Q"]) + p["bq"][None, :, None, :]
            k = heads(p["K"])
            A = self.torch.softmax((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh)), dim=-1)
            z = A @ v
        zc = z.transpose(1, 2).reshape(N * T, H * dh)
        # the LayerNorms' eps where the fit has it (clipped as block_refit's)
        eps = p["leps"].clamp(*LEPS_RANGE).exp() if "leps" in p else 0.0
        zz = _normalize(Xf + zc @ p["Wo"].T + p["bo"], eps) * p["g1"]
        n2 = _normalize(zz + self.act(zz @ p["W1"].T + p["b1"]) @ p["W2"].T + p["b2"], eps)
        res = n2 * p["g2"] + p["be2"] - Y.reshape(N * T, d)
        return 0.5 * (res * res).sum()


class OneTokenLoss(_Loss):
    """``(theta, shift=None) -> (loss, gradient)`` of :func:`.one_token_refit.loss_and_grad` on ``device``."""

    def __init__(self, shapes: dict, X: np.ndarray, Y: np.ndarray, device: str, activation: str = "gelu"):
        super().__init__(shapes, device)
        self.act = _act(activation)
        self.X, self.Y = self.tensor(X), self.tensor(Y)

    def __call__(self, theta: np.ndarray, shift=None) -> tuple[float, np.ndarray]:
        def loss_of(p):
            m = _normalize(self.X @ p["B"].T + p["b"])
            n = _normalize(m * p["gam"] + p["c"] + self.act(m @ p["W1"].T + p["b1"]) @ p["W2"].T)
            res = n * p["g2"] + p["be2"] - (self.Y if shift is None else self.Y - self.tensor(shift))
            return 0.5 * (res * res).sum()
        return self.run(theta, loss_of)


__all__ = ["BlockLoss", "DEVICES", "OneTokenLoss", "check_device"]
