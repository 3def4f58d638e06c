"""A copy of kernels/triton_attention.py with textual edits, imported as a module of its own (the
shipped kernel stays untouched): how `timeline.py` instruments the kernel and `variants.py` drops
parts of it. Each anchor must occur exactly once, so an edit that no longer fits the kernel fails
loudly instead of timing something else."""

from __future__ import annotations

import importlib.util
import pathlib
import tempfile
from types import ModuleType

SRC = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "triton_attention.py"


def edited_copy(name: str, edits: list[tuple[str, str]]) -> ModuleType:
    """The attention module with each `(anchor, replacement)` of `edits` applied, as `attn_NAME`."""
    text = SRC.read_text()
    for anchor, new in edits:
        assert text.count(anchor) == 1, f"{name}: anchor not unique in {SRC.name}: {anchor!r}"
        text = text.replace(anchor, new)
    path = pathlib.Path(tempfile.mkdtemp()) / f"attn_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"attn_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
