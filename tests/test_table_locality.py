"""scripts/table_locality.py: the locality figures of block tables, and a short engine stream."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import table_locality as tl


def test_table_stats_of_known_tables() -> None:
    """Identity rows are one run each and stay in their page; alternating ids never touch."""
    identity = [list(range(i * 64, (i + 1) * 64)) for i in range(4)]
    s = tl.table_stats(identity, page_blocks=64)
    assert s["adjacent"] == 1.0 and s["run"] == 64 and s["page"] == 1.0
    assert s["pages_per_seq_vs_fewest"] == 1.0
    spread = [[0, 10, 20, 30], [5, 500, 1000]]
    s = tl.table_stats(spread, page_blocks=8)
    assert s["adjacent"] == 0.0 and s["run"] == 1.0 and s["page"] == 0.0
    assert s["pages_per_seq_vs_fewest"] == (4 + 3) / 2
    assert tl.table_stats([[7]], page_blocks=8)["tables"] == 0  # a one-block table has no pair


def test_a_tight_pool_scatters_the_tables() -> None:
    """The engine's scheduler and pool, no model: in a pool the stream keeps full, later tables
    are less local than the first ones (freed blocks return in every order)."""
    r = tl.simulate(
        num_requests=320, max_num_seqs=32, num_blocks=400, prompt_len=(20, 120),
        output_len=(20, 120), snapshots=3,
    )  # fmt: skip
    shots = r["snapshots"]
    assert len(shots) == 3 and all(s["tables"] > 0 for s in shots)
    assert all(0.0 <= s["adjacent"] <= 1.0 and 0.0 <= s["page"] <= 1.0 for s in shots)
    assert shots[-1]["adjacent"] < shots[0]["adjacent"] / 4  # (0.17 -> 0.01 with seed 0)
