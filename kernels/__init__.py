"""Attention and KV-write ops behind one signature each (pure-PyTorch reference for now).

The Triton kernels will be dispatched from here under the same names; callers never import a
backend module directly.
"""

from kernels.reference import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
