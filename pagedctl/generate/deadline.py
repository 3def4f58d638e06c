"""The job's time limit (`--time-limit 2h`): at the limit no new line is admitted; the requests
already in the engine run to their end for at most a drain allowance more, then whatever still runs
is dropped, as a SIGTERM drops it, for the next run to compute again."""

from __future__ import annotations

import re
import time

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
DRAIN_MAX_S = 600.0  # the most a job runs past its limit to finish what it admitted
DRAIN_SHARE = 0.1  # ... and at most this share of the limit


def parse_duration(text: str, allow_zero: bool = False) -> float:
    """Seconds from `90`, `90s`, `45m`, `2h`, `1h30m`, `1d`; ValueError with the forms taken."""
    raw = str(text).strip().lower()
    try:
        seconds = float(raw)
    except ValueError:
        parts = _PART.findall(raw)
        if not parts or "".join(n + u for n, u in parts) != raw:
            raise ValueError(
                f"{text!r} is not a duration: give seconds (90) or a number with a unit, "
                "s, m, h or d (45m, 2h, 1h30m)"
            ) from None
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds == float("inf") or not (seconds > 0 or (allow_zero and seconds == 0)):
        raise ValueError(f"{text!r}: a duration must be above 0")
    return seconds


class Deadline:
    """A time limit counted from `start` (a `time.monotonic()` reading; the command's start)."""

    def __init__(self, limit_s: float | None, start: float | None = None) -> None:
        self.limit_s = limit_s
        self.start = time.monotonic() if start is None else start

    @property
    def drain_s(self) -> float:
        return min(DRAIN_MAX_S, DRAIN_SHARE * self.limit_s) if self.limit_s else 0.0

    def reached(self) -> bool:
        """Whether no new work may start."""
        return self.limit_s is not None and time.monotonic() - self.start >= self.limit_s

    def overrun(self) -> bool:
        """Whether the drain allowance is spent too: drop what still runs."""
        if self.limit_s is None:
            return False
        return time.monotonic() - self.start >= self.limit_s + self.drain_s
