"""Interpreter runs of the Triton kernels check every memory access (tests/interp_bounds.py)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interp_bounds import install

    install()
