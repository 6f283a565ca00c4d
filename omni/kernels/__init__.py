"""Kernels: cost-scheduled varlen attention, cost balancing and encoder-output resharding.

Every kernel has a pure-PyTorch reference in ``omni.kernels.reference`` (what runs on the CPU
and what the tests compare with). Triton is an optional dependency: importing this package
never needs it; a Triton backend is loaded when it is asked for.
"""
from omni.kernels.varlen_attention import BACKENDS, resolve_backend, varlen_attention

__all__ = ["BACKENDS", "resolve_backend", "varlen_attention"]
