"""The environment a figure was measured in, recorded next to every result."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pagedctl import __version__


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The checkout's commit (`-dirty` when code differs from it), or `PAGEDCTL_COMMIT` where the
    caller sets it: on a machine that got a copy of the working tree whose git metadata lags,
    the caller knows the commit and git does not."""
    if os.environ.get("PAGEDCTL_COMMIT"):
        return os.environ["PAGEDCTL_COMMIT"]
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        # Dirty means code differs from the commit; notes and results being written do not count.
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(here),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!*.md",
                ":!results",
            ],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _pkg(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    """Machine, software versions and the pagedctl commit, as a JSON-ready dict."""
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "pagedctl": __version__,
        "commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "ci": os.environ.get("CI") == "true",
    }
    for pkg in ("torch", "triton", "transformers"):
        env[pkg] = _pkg(pkg)
    torch = sys.modules.get("torch")  # the card, where the caller has torch loaded and a GPU
    if torch is not None and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env
