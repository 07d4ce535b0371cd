"""Shared by the refit tests: central finite differences of a scalar function, the gradients' reference."""

import numpy as np


def numeric_grad(f, theta, h=1e-6):
    """``df/dtheta`` by central differences of step ``h`` in every coordinate."""
    g = np.zeros_like(theta)
    for i in range(theta.size):
        e = np.zeros_like(theta)
        e[i] = h
        g[i] = (f(theta + e) - f(theta - e)) / (2 * h)
    return g
