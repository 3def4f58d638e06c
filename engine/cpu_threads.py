"""How many CPU threads torch runs each operation on (`num_threads`, `--threads`).

torch starts one intra-op thread per CPU, and its OpenMP threads spin-wait for each other at the
end of every parallel region. When another process holds one of those CPUs, every region waits
for the thread that lost its CPU, so a job slows down many times over, not in proportion to the
CPU it lost: on a 2-core machine beside one or two busy processes, the default 2 threads ran 2 to
5 times slower than 1 (results/cpu-threads.md). Too few threads costs at most the share of the
CPUs left idle, so the automatic choice leans low.

The automatic rule (`choose_threads`), on the CPU only:

1. OMP_NUM_THREADS or MKL_NUM_THREADS set: the user chose; keep the count torch took from it.
2. Otherwise start from the CPUs this process may run on (`os.sched_getaffinity`, else
   `os.cpu_count()`), capped by a cgroup CPU quota (`cpu.max`, or v1's `cpu.cfs_quota_us`: a
   container given 2 CPUs of a 64-core host) and by torch's own count (it only ever lowers it).
3. Take away the CPUs that other processes keep busy, measured from `/proc/stat` over
   `SAMPLE_S` while this process sleeps: the busy fraction of each CPU in the affinity set,
   summed, less this process's own CPU time over the window. The 1-minute load average is only
   the fallback where there is no `/proc/stat`: it lags a minute behind (a job that ended 30 s
   ago still counts) and covers the whole machine, not the CPUs we may use.
4. Round down, except that a CPU at least `1 - MARGIN` free counts as free; never below 1.

The choice is made once per process, at the first engine start, and kept by later engines and
`reconfigure` (a sweep's points must not differ in their thread count by accident); a given
`num_threads` applies at every start. While a run goes on, `ThreadWatch` takes the same
measure again every `RECHECK_S` over the whole time since the last one (no sleep: the engine's
own steps fill the window; a window past `STALE_S` spans an idle engine and only starts a new
one), and moves the count when the other work on the machine came or went:
a nightly job started on an idle machine must not spin two threads against a backup that began
an hour later. On CUDA, torch's count stands unless `num_threads` is given:
the host threads only launch work there.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Mapping

import torch

logger = logging.getLogger("pagedctl.engine")

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SAMPLE_S = 0.15  # long enough for 15 clock ticks per CPU, short beside loading a model
MARGIN = 0.25  # a CPU busy with other work less than a quarter of the time still counts as free
RECHECK_S = 5.0  # how often a running engine measures the other work again
STALE_S = 2 * RECHECK_S  # a longer window spans time the engine sat idle: it starts over

_auto: tuple[int, str] | None = None  # this process's automatic choice, made once
_shown: tuple[int, str] | None = None  # the last choice logged


def choose_threads(
    cpus: int,
    torch_threads: int,
    *,
    quota: float | None = None,
    busy: float | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str]:
    """The thread count for the CPU and the reason, in words, from what was measured.

    Args:
        cpus: CPUs in this process's affinity set.
        torch_threads: torch's intra-op thread count before any choice (it follows
            OMP_NUM_THREADS when that is set).
        quota: the cgroup CPU quota in CPUs (1.5: 150 ms of CPU per 100 ms), None when unlimited.
        busy: CPUs of the affinity set kept busy by other processes (1.6: one and a bit), None
            when it could not be measured.
        env: the environment (OMP_NUM_THREADS, MKL_NUM_THREADS).
    """
    env = env or {}
    for var in ENV_VARS:
        if env.get(var, "").strip():
            return max(1, torch_threads), f"{var}={env[var].strip()} in the environment"
    cpus = max(1, cpus)
    room = float(cpus)
    why = [f"{cpus} CPU{'s' if cpus != 1 else ''} in affinity"]
    if quota is not None and quota < room:
        room = quota
        why.append(f"a cgroup quota of {quota:g} CPUs")
    if torch_threads < room:
        room = float(torch_threads)
        why.append(f"torch's default of {torch_threads}")
    if busy is not None:
        busy = max(0.0, busy)
        room = min(room, cpus - busy)
        why.append(f"{busy:.1f} busy with other work")
    threads = max(1, math.floor(room + MARGIN))
    return threads, ", ".join(why)


def affinity_cpus() -> list[int] | None:
    """The CPUs this process may run on, or None where the system does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def parse_cpu_max(text: str) -> float | None:
    """CPUs from a cgroup v2 `cpu.max` ("200000 100000": 2.0; "max 100000": None)."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100000
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> float | None:
    """The tightest CPU quota over this process's cgroup and its parents, in CPUs; None if none.

    cgroup v2 (`cpu.max`) and v1 (`cpu/cpu.cfs_quota_us` over `cpu.cfs_period_us`), each at the
    mount's root (what a container sees as its own) and along the path `/proc/self/cgroup` names.
    """
    paths = {"v2": "/", "v1": "/"}
    try:
        with open(self_cgroup, encoding="ascii") as f:
            for line in f:
                hier, controllers, path = line.rstrip("\n").split(":", 2)
                if hier == "0" and controllers == "":
                    paths["v2"] = path
                elif "cpu" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    found = []
    for folder in _ancestors(root, paths["v2"]):
        found.append(_read_quota(os.path.join(folder, "cpu.max")))
    for folder in _ancestors(os.path.join(root, "cpu"), paths["v1"]):
        quota = _read_int(os.path.join(folder, "cpu.cfs_quota_us"))
        period = _read_int(os.path.join(folder, "cpu.cfs_period_us"))
        if quota is not None and period and quota > 0:
            found.append(quota / period)
    limits = [q for q in found if q is not None]
    return min(limits) if limits else None


def _ancestors(root: str, path: str) -> Iterable[str]:
    parts = [p for p in path.split("/") if p and p != ".."]
    for i in range(len(parts), -1, -1):
        yield os.path.join(root, *parts[:i])


def _read_quota(path: str) -> float | None:
    try:
        with open(path, encoding="ascii") as f:
            return parse_cpu_max(f.read())
    except (OSError, ValueError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def parse_proc_stat(text: str) -> dict[int, tuple[int, int]]:
    """(busy ticks, all ticks) of each CPU from `/proc/stat`'s `cpuN` lines.

    Busy is user, nice, system, irq, softirq and steal (a hypervisor's taking is a CPU we do not
    have); idle and iowait are free. guest time is already inside user.
    """
    out: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        v = [int(x) for x in rest.split()] + [0] * 8
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        out[int(name[3:])] = (busy, busy + v[3] + v[4])
    return out


def busy_between(
    before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]], cpus: Iterable[int]
) -> float:
    """CPUs kept busy between two `/proc/stat` readings, over the CPUs in `cpus`."""
    busy = 0.0
    for cpu in cpus:
        if cpu in before and cpu in after:
            ticks = after[cpu][1] - before[cpu][1]
            if ticks > 0:
                busy += min(1.0, max(0.0, (after[cpu][0] - before[cpu][0]) / ticks))
    return busy


def measure_busy(cpus: list[int] | None, window_s: float = SAMPLE_S) -> float | None:
    """CPUs of `cpus` that other processes keep busy now, less this process's own use; the load
    average where there is no `/proc/stat`, None where there is neither."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            before = parse_proc_stat(f.read())
        wall0, own0 = time.monotonic(), time.process_time()
        time.sleep(window_s)
        with open("/proc/stat", encoding="ascii") as f:
            after = parse_proc_stat(f.read())
        wall, own = time.monotonic() - wall0, time.process_time() - own0
    except (OSError, ValueError):
        try:
            return os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    if not before:
        return None
    busy = busy_between(before, after, cpus if cpus is not None else sorted(before))
    return max(0.0, busy - own / wall) if wall > 0 else busy


def _read_proc_stat() -> dict[int, tuple[int, int]] | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            return parse_proc_stat(f.read()) or None
    except (OSError, ValueError):
        return None


class ThreadWatch:
    """Re-chooses the automatic thread count while the engine runs (see the module docstring).

    `tick()` is cheap (a clock read) except every `RECHECK_S`, when it reads `/proc/stat` and
    this process's CPU time and compares them with the last reading. It must run on the thread
    that runs the model: `torch.set_num_threads` sets the calling thread's pool.
    """

    def __init__(self, cpus: list[int] | None, torch_threads: int, quota: float | None) -> None:
        self.cpus = cpus
        self.count = len(cpus) if cpus else (os.cpu_count() or 1)
        self.torch_threads, self.quota = torch_threads, quota
        self._mark: tuple[float, float, dict[int, tuple[int, int]]] | None = None

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._mark is not None and now - self._mark[0] < RECHECK_S:
            return
        stat = _read_proc_stat()
        if stat is None:
            return
        own = time.process_time()
        # A window much longer than RECHECK_S spans time between the engine's runs (another
        # program's work then, a benchmark's other side) that says nothing about now: it only
        # starts a new window.
        if self._mark is not None and now - self._mark[0] <= STALE_S:
            wall = now - self._mark[0]
            busy = busy_between(self._mark[2], stat, self.cpus or sorted(stat))
            self.adjust(max(0.0, busy - (own - self._mark[1]) / wall))
        self._mark = (now, own, stat)

    def adjust(self, busy: float) -> int:
        """Apply the count for `busy` CPUs of other work; log it when it changes."""
        threads, why = choose_threads(
            self.count, self.torch_threads, quota=self.quota, busy=busy, env={}
        )
        current = torch.get_num_threads()
        if threads != current:
            torch.set_num_threads(threads)
            logger.info("CPU threads: %d, was %d (%s)", threads, current, why)
        return threads


def watch_threads(num_threads: int | None, device_type: str) -> ThreadWatch | None:
    """A `ThreadWatch` for an engine whose count is automatic on the CPU, else None."""
    if num_threads is not None or device_type != "cpu":
        return None
    if any(os.environ.get(v, "").strip() for v in ENV_VARS):
        return None
    return ThreadWatch(affinity_cpus(), _torch_default(), cgroup_cpu_quota())


def auto_threads(torch_threads: int, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """This process's automatic choice: measured at the first call, the same ever after."""
    global _auto
    if _auto is None:
        env = os.environ if env is None else env
        if any(env.get(v, "").strip() for v in ENV_VARS):
            _auto = choose_threads(0, torch_threads, env=env)
        else:
            cpus = affinity_cpus()
            count = len(cpus) if cpus else (os.cpu_count() or 1)
            _auto = choose_threads(
                count, torch_threads, quota=cgroup_cpu_quota(), busy=measure_busy(cpus)
            )
    return _auto


def apply_threads(num_threads: int | None, device_type: str) -> int:
    """Set torch's intra-op thread count for an engine on `device_type`; returns it.

    A given count is applied as it is; None chooses on the CPU (see the module's docstring) and
    leaves torch's count on CUDA. The choice is logged when it changes.
    """
    global _shown
    default = _torch_default()
    if num_threads is not None:
        threads, why = num_threads, "num_threads given"
    elif device_type != "cpu":
        return torch.get_num_threads()
    else:
        threads, why = auto_threads(default)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if _shown != (threads, why):
        _shown = (threads, why)
        logger.info("CPU threads: %d (%s)", threads, why)
    return threads


_first_torch_threads: int | None = None


def _torch_default() -> int:
    """torch's thread count before this module first changed it."""
    global _first_torch_threads
    if _first_torch_threads is None:
        _first_torch_threads = torch.get_num_threads()
    return _first_torch_threads
