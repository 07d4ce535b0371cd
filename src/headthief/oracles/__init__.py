"""Oracles: the black boxes headthief queries, and the wrappers that model what an API returns."""

from .antisymmetric import AntiSymmetric
from .base import CallableOracle, ModelOracle, Oracle, WrappedOracle, as_batch
from .sign_only import SignOnly
from .tolerance import Tolerance
from .transcript import Transcript

__all__ = ["AntiSymmetric", "Oracle", "ModelOracle", "CallableOracle", "WrappedOracle", "SignOnly", "Tolerance", "Transcript", "as_batch"]
