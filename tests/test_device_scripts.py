"""The device scripts that time textual copies of the decode kernel (`scripts/device/variants.py`,
`deal_probe.py`, `timeline.py`) still fit the shipped kernel: every edit's anchor occurs exactly
once in kernels/triton_attention.py, so a change to the kernel cannot leave a copy that silently
times something else (or fails only after a device call has started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DEVICE = Path(__file__).resolve().parents[1] / "scripts" / "device"


@pytest.fixture(scope="module")
def device_scripts():
    sys.path.insert(0, str(DEVICE))
    try:
        import deal_probe
        import timeline
        import variants
        from kernel_copy import edited_copy

        yield variants, deal_probe, timeline, edited_copy
    finally:
        sys.path.remove(str(DEVICE))


def test_every_kernel_copy_applies_and_imports(device_scripts) -> None:
    variants, deal_probe, timeline, edited_copy = device_scripts
    copies = {**variants.VARIANTS, **deal_probe.VARIANTS}
    for name, edits in copies.items():
        mod = edited_copy(name, edits)  # asserts each anchor is unique, then imports the copy
        assert hasattr(mod, "paged_attention"), name
    mod = edited_copy("stamped", timeline.EDITS)
    assert hasattr(mod, "paged_attention")


def test_a_stale_anchor_fails_loudly(device_scripts) -> None:
    edited_copy = device_scripts[3]
    with pytest.raises(AssertionError, match="anchor not unique"):
        edited_copy("stale", [("this text is not in the kernel", "")])
