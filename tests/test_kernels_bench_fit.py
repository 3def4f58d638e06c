"""The kernel bench's split of a decode time into a fixed cost per call and a streaming rate."""

from __future__ import annotations

import pytest

from kernels.bench import fixed_and_streaming


def _row(shape: str, batch: int, block: int, nbytes: float, seconds: float) -> dict:
    return {"shape": shape, "batch": batch, "block": block, "bytes": nbytes,
            "ms_random": seconds * 1e3}  # fmt: skip


def test_fit_recovers_the_fixed_cost_and_the_rate_of_a_line() -> None:
    line = [_row("m", 64, 16, b, 6e-6 + b / 3.0e12) for b in (1.7e7, 6.7e7, 2.7e8, 1.07e9)]
    off_line = [_row("m", 64, 32, b, (6e-6 + b / 3.0e12) * k) for b, k in
                [(1.7e7, 1.1), (6.7e7, 1.0), (2.7e8, 1.0), (1.07e9, 1.0)]]  # fmt: skip
    two_points = [_row("m", 1, 16, b, 1e-5) for b in (1e6, 2e6)]
    fits = {f["block"]: f for f in fixed_and_streaming(line + off_line + two_points, 4.0e12)}
    assert set(fits) == {16, 32}  # two contexts are not enough for a line
    exact = fits[16]
    assert exact["contexts"] == 4
    assert exact["fixed_us"] == pytest.approx(6.0, rel=1e-6)
    assert exact["rate_fraction"] == pytest.approx(0.75, rel=1e-6)
    assert exact["worst_residual"] == pytest.approx(0.0, abs=1e-9)
    assert 0.01 < fits[32]["worst_residual"] < 0.1  # the shortest context sits 10% above
