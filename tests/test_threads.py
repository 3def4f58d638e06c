"""The CPU thread count: the automatic rule on made-up machines, and the files it reads."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedctl.engine import cpu_threads as th
from pagedctl.engine.core.config import ConfigError, EngineConfig


@pytest.mark.parametrize(
    ("cpus", "torch_threads", "quota", "busy", "want"),
    [
        (2, 2, None, 0.0, 2),  # an idle machine: torch's own count
        (2, 2, None, 0.2, 2),  # a CPU busy less than a quarter of the time still counts
        (2, 2, None, 1.0, 1),  # one busy process on two cores
        (2, 2, None, 1.6, 1),
        (2, 2, None, 2.0, 1),  # never below one
        (2, 2, None, 5.0, 1),
        (64, 64, 2.0, 0.0, 2),  # a container given 2 CPUs of a 64-core host
        (64, 64, 1.5, 0.0, 1),  # half a CPU of quota is not a thread
        (64, 64, 0.5, 0.0, 1),
        (64, 64, None, 10.4, 53),
        (64, 32, None, 0.0, 32),  # torch counts physical cores: never above its count
        (8, 8, 6.0, 4.0, 4),  # the busy CPUs come off the affinity set, then the quota caps
        (2, 2, None, None, 2),  # nothing measured: affinity and quota only
    ],
)
def test_choose_threads(cpus, torch_threads, quota, busy, want):
    threads, _ = th.choose_threads(cpus, torch_threads, quota=quota, busy=busy, env={})
    assert threads == want


def test_reason_names_what_decided():
    _, why = th.choose_threads(2, 2, busy=1.6, env={})
    assert why == "2 CPUs in affinity, 1.6 busy with other work"
    _, why = th.choose_threads(64, 64, quota=2.0, busy=0.0, env={})
    assert "a cgroup quota of 2 CPUs" in why


@pytest.mark.parametrize("var", th.ENV_VARS)
def test_the_environment_wins_over_the_rule(var):
    assert th.choose_threads(2, 3, busy=2.0, env={var: "3"}) == (3, f"{var}=3 in the environment")
    assert th.choose_threads(2, 2, busy=2.0, env={var: " "})[0] == 1  # empty: not set


@pytest.mark.parametrize(
    ("text", "want"),
    [("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5), ("", None)],
)
def test_parse_cpu_max(text, want):
    assert th.parse_cpu_max(text) == want


def test_cgroup_quota_v2_takes_the_tightest_ancestor(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    own = tmp_path / "self_cgroup"
    own.write_text("0::/a/b\n")
    assert th.cgroup_cpu_quota(str(tmp_path), str(own)) == 3.0


def test_cgroup_quota_v1_and_none(tmp_path):
    (tmp_path / "cpu").mkdir()
    own = tmp_path / "self_cgroup"
    own.write_text("3:cpu,cpuacct:/\n0::/\n")
    assert th.cgroup_cpu_quota(str(tmp_path), str(own)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert th.cgroup_cpu_quota(str(tmp_path), str(own)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert th.cgroup_cpu_quota(str(tmp_path), str(own)) == 2.0


STAT_0 = """cpu  300 0 60 500 40 0 0 0 0 0
cpu0 100 0 20 300 20 0 0 0 0 0
cpu1 200 0 40 200 20 0 0 0 0 0
cpu2 0 0 0 0 0 0 0 0 0 0
intr 5 0 0
"""
STAT_1 = """cpu  300 0 60 500 40 0 0 0 0 0
cpu0 190 0 30 300 20 0 0 0 0 0
cpu1 200 0 40 300 20 0 0 0 0 0
cpu2 100 0 0 0 0 0 0 0 0 0
"""


def test_busy_between_counts_only_our_cpus():
    before, after = th.parse_proc_stat(STAT_0), th.parse_proc_stat(STAT_1)
    assert set(before) == {0, 1, 2}
    assert before[0] == (120, 440)  # idle and iowait are free
    assert th.busy_between(before, after, [0, 1]) == pytest.approx(1.0)  # 100 of 100; 0 of 100
    assert th.busy_between(before, after, [0, 1, 2]) == pytest.approx(2.0)
    assert th.busy_between(before, after, [1]) == 0.0


def test_num_threads_setting():
    c = EngineConfig.from_mapping({"threads": 2})  # the alias, as a recipe or --threads gives it
    assert c.num_threads == 2
    assert EngineConfig().num_threads is None
    with pytest.raises(ConfigError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_apply_threads(monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    monkeypatch.setattr(th, "_auto", (1, "made up"))
    monkeypatch.setattr(th, "_shown", None)
    try:
        with caplog.at_level(logging.INFO, logger="pagedctl.engine"):
            assert th.apply_threads(None, "cpu") == 1
            assert torch.get_num_threads() == 1
            assert th.apply_threads(None, "cuda") == 1  # CUDA leaves torch's count as it is
            assert th.apply_threads(2, "cuda") == 2
        assert [r.getMessage() for r in caplog.records] == [
            "CPU threads: 1 (made up)",
            "CPU threads: 2 (num_threads given)",
        ]
    finally:
        torch.set_num_threads(before)


def test_a_running_engine_follows_the_other_work(monkeypatch, caplog):
    """Other work that starts after the engine (a backup an hour into a nightly job) takes the
    count down; work that ends gives it back. Each reading spans the time since the last."""
    before = torch.get_num_threads()
    ticks = {"busy": 0, "all": 0}
    own = {"cpu": 0.0}

    def stat():  # two CPUs; their busy and total ticks, 100 per second each
        return {
            0: (ticks["busy"] // 2, ticks["all"] // 2),
            1: (ticks["busy"] // 2, ticks["all"] // 2),
        }

    def elapse(seconds: float, others: float, ours: float) -> None:
        ticks["all"] += int(200 * seconds)
        ticks["busy"] += int(100 * seconds * (others + ours))
        own["cpu"] += seconds * ours

    monkeypatch.setattr(th, "_read_proc_stat", stat)
    monkeypatch.setattr(th.time, "process_time", lambda: own["cpu"])
    watch = th.ThreadWatch([0, 1], 2, None)
    try:
        torch.set_num_threads(2)
        now = 100.0
        watch.tick(now)  # the first reading only marks the time
        with caplog.at_level(logging.INFO, logger="pagedctl.engine"):
            elapse(th.RECHECK_S, others=1.0, ours=1.0)  # a busy process came: it shares the CPUs
            now += th.RECHECK_S
            watch.tick(now)
            assert torch.get_num_threads() == 1
            elapse(1.0, others=1.0, ours=1.0)
            watch.tick(now + 1.0)  # not yet time to look again
            assert torch.get_num_threads() == 1
            elapse(th.RECHECK_S, others=0.0, ours=1.0)  # it ended: one CPU idles
            now += th.RECHECK_S
            watch.tick(now)
            assert torch.get_num_threads() == 2
            # the engine sits idle while another program runs, then runs alone again: the
            # reading that spans the pause starts a new window instead of taking the count down
            elapse(60.0, others=2.0, ours=0.0)
            now += 60.0
            watch.tick(now)
            assert torch.get_num_threads() == 2
            elapse(th.RECHECK_S, others=0.0, ours=2.0)
            now += th.RECHECK_S
            watch.tick(now)
            assert torch.get_num_threads() == 2
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2
        assert messages[0].startswith("CPU threads: 1, was 2 (2 CPUs in affinity, 1.0 busy")
        assert messages[1].startswith("CPU threads: 2, was 1")
    finally:
        torch.set_num_threads(before)


def test_no_watch_when_the_count_is_given_or_not_on_the_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert th.watch_threads(2, "cpu") is None
    assert th.watch_threads(None, "cuda") is None
    assert isinstance(th.watch_threads(None, "cpu"), th.ThreadWatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert th.watch_threads(None, "cpu") is None
