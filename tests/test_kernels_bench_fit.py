"""The kernel bench's split of a decode time into a fixed cost per call and a streaming rate."""

from __future__ import annotations

import pytest
from pagedctl.kernels.bench_report import fixed_and_streaming


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


def test_tables_render_without_a_gpu_with_and_without_the_newer_columns(tmp_path) -> None:
    """`--render` redraws older JSON (no plain read, no per-pair overheads) and newer JSON."""
    from pagedctl.kernels.bench_report import write

    env = {"gpu": "card", "dtype": "bfloat16", "torch": "t", "triton": "tr", "sms": 132,
           "copy_bandwidth_GBps": 4e3, "matmul_TFLOPs": 7e2, "empty_kernel_us": 0.7}  # fmt: skip

    def row(ctx: int, **extra: object) -> dict:
        return {"shape": "qwen2.5-0.5b", "batch": 64, "context": ctx, "block": 16,
                "ms_random": 0.0232, "ms_eager": 0.03, "bw_fraction": 0.68,
                "paging_overhead": 0.01, "split_speedup": 1.2, "ms_splits": {},
                "bytes": 6.7e7, **extra}  # fmt: skip

    decode = [row(2048), row(8192, paging_overhead_pairs=[-0.004, 0.031, 0.01, 0.012])]
    peers = [
        {"shape": "qwen2.5-0.5b", "batch": 64, "context": 2048, "ms_sdpa": 0.025, "ms_flex": None},
        {"shape": "qwen2.5-0.5b", "batch": 64, "context": 8192, "ms_sdpa": 0.08, "ms_flex": 0.25,
         "ms_read": 0.0186},
    ]  # fmt: skip
    text = write(tmp_path, env, decode, peers, [])
    old, new = (line for line in text.splitlines() if line.startswith("| qwen2.5-0.5b | 64 |"))
    assert "| +1.0% |" in old and old.endswith("| n/a | n/a | n/a |")
    assert "| +1.0% (-0.4%..+3.1%) |" in new and new.endswith("| 250.0 | 18.6 | 1.25 |")
    assert (tmp_path / "kernels.md").read_text() == text + "\n"
    assert (tmp_path / "kernels.json").exists()


def test_merged_tables_name_each_run_and_its_commit(tmp_path) -> None:
    """A table merged from several runs says which run timed what, at which commit: the commit
    its caller gave (`PAGEDCTL_COMMIT`), or a note set by hand in an older JSON."""
    from pagedctl.kernels.bench_report import write

    env = {"gpu": "card", "dtype": "bfloat16", "torch": "t", "triton": "tr", "sms": 132,
           "copy_bandwidth_GBps": 4e3, "matmul_TFLOPs": 7e2, "empty_kernel_us": 0.7}  # fmt: skip
    runs = [
        {**env, "shapes": ["qwen2.5-0.5b"], "batches": [1, 64], "commit": "abc1234"},
        {**env, "note": "batch 256 at 3313a2a"},
        {**env, "commit": None},  # a run that was given no commit says nothing
    ]
    text = write(tmp_path, {**env, "runs": runs}, [], [], [])
    assert "Runs: qwen2.5-0.5b batches 1, 64 at abc1234; batch 256 at 3313a2a." in text
    assert "Runs:" not in write(tmp_path, env, [], [], [])


def test_environment_takes_the_commit_its_caller_gives(monkeypatch) -> None:
    from pagedctl import envinfo

    monkeypatch.setenv("PAGEDCTL_COMMIT", "c5431a7")
    assert envinfo.environment()["commit"] == "c5431a7"


@pytest.mark.parametrize("max_programs", [264, 528, 1056])
def test_plain_read_grid_reads_the_bytes_in_whole_tiles_with_no_idle_program(
    max_programs: int,
) -> None:
    """Every bench size (and a few odd ones): at least the bytes asked, by less than one
    program's share (session 6's first sizing read 3% more and scaled the time back: wrong
    for small reads), no more programs than asked for, none without a tile."""
    from pagedctl.kernels.bench_timing import READ_TILE, read_grid

    sizes = [2 * b * c * h * 64 * 2 for b in (1, 8, 64, 256) for c in (512, 2048, 8192, 32768)
             for h in (2, 3)] + [1, 8191, 8193, 10**9 + 7]  # fmt: skip
    for nbytes in sizes:
        programs, per_program = read_grid(nbytes, max_programs)
        assert per_program % READ_TILE == 0 and 1 <= programs <= max_programs
        read = 2 * programs * per_program
        assert nbytes <= read < nbytes + 2 * per_program
        assert 2 * (programs - 1) * per_program < nbytes  # the last program has bytes to read


@pytest.mark.parametrize("run", [1, 8, 64, 4096])
def test_runs_table_shuffles_runs_of_consecutive_blocks(run: int) -> None:
    """`sweep --tables`: a permutation of every block id whose runs of `run` entries are
    consecutive ids from a multiple of `run`; 1 is a random table, all the blocks the identity."""
    import torch
    from pagedctl.kernels.sweep_access import runs_table

    table = runs_table(8, 512, run, "cpu")
    flat = table.flatten()
    every = torch.arange(8 * 512, dtype=torch.int32)
    assert table.shape == (8, 512) and table.dtype == torch.int32
    assert torch.equal(flat.sort().values, every)
    runs = flat.view(-1, run)
    assert (runs[:, 0] % run == 0).all() and (runs.diff(dim=1) == 1).all()
    assert torch.equal(flat, every) == (run == 8 * 512)


def test_in_page_table_shuffles_only_within_pages() -> None:
    """`sweep --tables`' "in pages": every block id once, each page's ids (groups of
    `page_blocks` from a multiple of it) kept in that page's slots, their order shuffled."""
    import torch
    from pagedctl.kernels.sweep_access import in_page_table

    torch.manual_seed(0)
    table = in_page_table(4, 256, 128, "cpu")
    flat = table.flatten()
    assert table.shape == (4, 256) and table.dtype == torch.int32
    assert torch.equal(flat.sort().values, torch.arange(4 * 256, dtype=torch.int32))
    slots = torch.arange(4 * 256)
    assert torch.equal(flat // 128, slots // 128)  # no id leaves its page
    assert not torch.equal(flat, slots.to(torch.int32))  # and within pages it moved


def test_split_scan_table_takes_every_count_any_row_has(tmp_path) -> None:
    """Rows of runs that scanned different split counts share one table (`-` where a row has no
    figure), and the `*` marks the count the run itself picked where the row recorded it (a
    policy has changed since older runs: today's pick would misstate what they timed)."""
    from pagedctl.kernels.bench_report import write

    env = {"gpu": "card", "dtype": "bfloat16", "torch": "t", "triton": "tr", "sms": 132,
           "copy_bandwidth_GBps": 4e3, "matmul_TFLOPs": 7e2, "empty_kernel_us": 0.5}  # fmt: skip
    base = {"shape": "qwen2.5-0.5b", "batch": 8, "block": 16, "ms_random": 0.01,
            "ms_eager": 0.02, "bw_fraction": 0.5, "paging_overhead": 0.0, "split_speedup": 5.0,
            "bytes": 1e7}  # fmt: skip
    older = {**base, "context": 2048, "ms_splits": {"1": 0.027, "8": 0.0082}}
    newer = {**base, "context": 8192, "ms_splits": {"1": 0.1, "8": 0.018, "24": 0.014},
             "splits_picked": 24}  # fmt: skip
    peers = [{"shape": "qwen2.5-0.5b", "batch": 8, "context": c, "ms_sdpa": 0.02, "ms_flex": None}
             for c in (2048, 8192)]  # fmt: skip
    text = write(tmp_path, env, [older, newer], peers, [])
    assert "| shape | batch | ctx | 1 | 8 | 24 |" in text
    assert "| qwen2.5-0.5b | 8 | 2048 | 27.0 | 8.2 | - |" in text  # no record, no mark
    assert "| qwen2.5-0.5b | 8 | 8192 | 100.0 | 18.0 | 14.0* |" in text


def test_targets_name_every_row_that_misses_and_only_those() -> None:
    """Issue 5's targets over a bench's rows: the bandwidth target looks at batch >= 64 and
    context >= 2K only, the split target at batch 1 and context >= 8K only; each lists exactly the
    rows that miss, and a target with no row measured is left out."""
    from pagedctl.kernels.bench_report import targets

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
