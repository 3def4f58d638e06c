"""The kernel benchmark's report (benchmarks/kernel_report.py) and plain-read sizing, without a GPU:
the split of a decode time into a fixed cost and a streaming rate, the tables, the targets."""

from __future__ import annotations

import pytest

from benchmarks.kernel_report import fixed_and_streaming


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


ENV = {"gpu": "card", "dtype": "bfloat16", "torch": "t", "triton": "tr", "sms": 132,
       "copy_bandwidth_GBps": 4e3, "matmul_TFLOPs": 7e2, "empty_kernel_us": 0.7,
       "graph_launch_us": 3.7}  # fmt: skip


def test_tables_render_without_a_gpu(tmp_path) -> None:
    """`--render` redraws a run's JSON: each row with its pairs' spread, the peers and the read."""
    from benchmarks.kernel_report import write

    def row(ctx: int, pairs: list[float]) -> dict:
        return {"shape": "qwen2.5-0.5b", "batch": 64, "context": ctx, "block": 16,
                "ms_random": 0.0232, "ms_eager": 0.03, "bw_fraction": 0.68,
                "paging_overhead": 0.01, "paging_overhead_pairs": pairs, "split_speedup": 1.2,
                "splits_picked": 1, "ms_splits": {}, "bytes": 6.7e7}  # fmt: skip

    decode = [row(2048, [0.0, 0.01, 0.01, 0.02]), row(8192, [-0.004, 0.031, 0.01, 0.012])]
    peers = [
        {"shape": "qwen2.5-0.5b", "batch": 64, "context": 2048, "ms_sdpa": 0.025, "ms_flex": None,
         "ms_read": 0.0116},
        {"shape": "qwen2.5-0.5b", "batch": 64, "context": 8192, "ms_sdpa": 0.08, "ms_flex": 0.25,
         "ms_read": 0.0186},
    ]  # fmt: skip
    text = write(tmp_path, ENV, decode, peers, [])
    short, long = (line for line in text.splitlines() if line.startswith("| qwen2.5-0.5b | 64 |"))
    assert "| +1.0% (+0.0%..+2.0%) |" in short and short.endswith("| n/a | 11.6 | 2.00 |")
    assert "| +1.0% (-0.4%..+3.1%) |" in long and long.endswith("| 250.0 | 18.6 | 1.25 |")
    assert "a graph's own launch adds 3.7 us to each replay" in text
    assert (tmp_path / "kernels.md").read_text() == text + "\n"
    assert (tmp_path / "kernels.json").exists()


def test_merged_tables_name_each_run_and_its_commit(tmp_path) -> None:
    """A table merged from several runs says which run timed what, at which commit (the one its
    caller gave in `PAGEDCTL_COMMIT`, else git's)."""
    from benchmarks.kernel_report import write

    runs = [
        {**ENV, "shapes": ["qwen2.5-0.5b"], "batches": [1, 64], "commit": "abc1234"},
        {**ENV, "shapes": ["smollm2-135m"], "batches": [256], "commit": "def5678"},
        {**ENV, "commit": None},  # a run that knew no commit says nothing
    ]
    text = write(tmp_path, {**ENV, "runs": runs}, [], [], [])
    runs_line = "Runs: qwen2.5-0.5b batches 1, 64 at abc1234; smollm2-135m batches 256 at def5678."
    assert runs_line in text
    assert "Runs:" not in write(tmp_path, ENV, [], [], [])


def test_environment_takes_the_commit_its_caller_gives(monkeypatch) -> None:
    from pagedctl import envinfo

    monkeypatch.setenv("PAGEDCTL_COMMIT", "c5431a7")
    assert envinfo.environment()["commit"] == "c5431a7"


@pytest.mark.parametrize("max_programs", [264, 528, 1056])
def test_plain_read_grid_reads_the_bytes_in_whole_tiles_with_no_idle_program(
    max_programs: int,
) -> None:
    """Every benchmark size (and a few odd ones): at least the bytes asked, by less than one
    program's share (a read of a few percent more, scaled back, misstates small reads), no more
    programs than asked for, none without a tile."""
    pytest.importorskip("triton")
    from benchmarks.kernel_timing import READ_TILE, read_grid

    sizes = [2 * b * c * h * 64 * 2 for b in (1, 8, 64, 256) for c in (512, 2048, 8192, 32768)
             for h in (2, 3)] + [1, 8191, 8193, 10**9 + 7]  # fmt: skip
    for nbytes in sizes:
        programs, per_program = read_grid(nbytes, max_programs)
        assert per_program % READ_TILE == 0 and 1 <= programs <= max_programs
        read = 2 * programs * per_program
        assert nbytes <= read < nbytes + 2 * per_program
        assert 2 * (programs - 1) * per_program < nbytes  # the last program has bytes to read


def test_split_scan_table_takes_every_count_any_row_has(tmp_path) -> None:
    """Rows of runs that scanned different split counts share one table (`-` where a row has no
    figure), and the `*` marks the count the run itself picked (the policy may have changed
    since: today's pick would misstate what a run timed)."""
    from benchmarks.kernel_report import write

    base = {"shape": "qwen2.5-0.5b", "batch": 8, "block": 16, "ms_random": 0.01,
            "ms_eager": 0.02, "bw_fraction": 0.5, "paging_overhead": 0.0,
            "paging_overhead_pairs": [0.0] * 4, "split_speedup": 5.0, "bytes": 1e7}  # fmt: skip
    short = {**base, "context": 2048, "ms_splits": {"1": 0.027, "8": 0.0082}, "splits_picked": 8}
    long = {**base, "context": 8192, "ms_splits": {"1": 0.1, "8": 0.018, "24": 0.014},
            "splits_picked": 24}  # fmt: skip
    peers = [{"shape": "qwen2.5-0.5b", "batch": 8, "context": c, "ms_sdpa": 0.02, "ms_flex": None,
              "ms_read": 0.005} for c in (2048, 8192)]  # fmt: skip
    text = write(tmp_path, ENV, [short, long], peers, [])
    assert "| shape | batch | ctx | 1 | 8 | 24 |" in text
    assert "| qwen2.5-0.5b | 8 | 2048 | 27.0 | 8.2* | - |" in text
    assert "| qwen2.5-0.5b | 8 | 8192 | 100.0 | 18.0 | 14.0* |" in text


def test_targets_name_every_row_that_misses_and_only_those() -> None:
    """The decode targets over a benchmark's rows: the bandwidth target looks at batch >= 64 and
    context >= 2K only, the split target at batch 1 and context >= 8K only; each lists exactly the
    rows that miss, and a target with no row measured is left out."""
    from benchmarks.kernel_report import targets

    def row(batch: int, ctx: int, block: int, bw: float, paging: float, speedup: float,
            ms: float) -> dict:  # fmt: skip
        return {"shape": "m", "batch": batch, "context": ctx, "block": block, "bw_fraction": bw,
                "paging_overhead": paging, "split_speedup": speedup, "ms_random": ms}  # fmt: skip

    decode = [
        row(64, 2048, 16, 0.74, 0.031, 1.2, 0.020),  # misses bandwidth and paging
        row(64, 2048, 64, 0.76, 0.005, 1.2, 0.019),
        row(64, 512, 16, 0.40, 0.0, 1.0, 0.009),  # below 2K: no bandwidth target
        row(1, 8192, 16, 0.10, 0.01, 4.5, 0.011),  # misses the split target, slower than SDPA
        row(1, 2048, 16, 0.05, 0.0, 3.0, 0.006),  # below 8K: no split target
    ]
    peers = [
        {"shape": "m", "batch": 64, "context": 2048, "ms_sdpa": 0.024, "ms_flex": 0.060},
        {"shape": "m", "batch": 64, "context": 512, "ms_sdpa": 0.011, "ms_flex": None},
        {"shape": "m", "batch": 1, "context": 8192, "ms_sdpa": 0.074, "ms_flex": 0.010},
        {"shape": "m", "batch": 1, "context": 2048, "ms_sdpa": 0.022, "ms_flex": None},
    ]
    got = {g["asked"]: g for g in targets(decode, peers)}
    bw, paging, splits, peer = got[">= 75%"], got["< +3%"], got[">= 5x"], got["<= 1.00x"]
    assert (bw["rows"], bw["worst"], bw["misses"]) == (2, "74.0%", ["m 64 x 2048 block 16: 74.0%"])
    assert paging["rows"] == 5 and paging["misses"] == ["m 64 x 2048 block 16: +3.1%"]
    assert (splits["rows"], splits["misses"]) == (1, ["m 1 x 8192 block 16: 4.5x"])
    # the best peer is the faster of SDPA and flex: flex at 1 x 8K (0.010 ms) beats the kernel
    assert peer["misses"] == ["m 1 x 8192 block 16: 1.10x"]
    assert peer["worst_row"] == "m 1 x 8192 block 16"
    assert [g["asked"] for g in targets(decode[2:3], peers)] == ["< +3%", "<= 1.00x"]
