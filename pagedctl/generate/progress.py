"""How a running job reports itself: a Rich bar on a terminal, periodic lines in a log, or nothing.

Log lines go to stderr, as text or (with `--log-format json`) one JSON object per line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

BAR_S = 0.1  # the terminal bar's figures are gathered at most this often


class Reporter:
    """Progress and log events of one job."""

    def __init__(self, total: int, *, quiet: bool, log_format: str, interval_s: float = 10.0):
        self.quiet = quiet
        self.json = log_format == "json"
        self.interval_s = interval_s
        self.err = Console(stderr=True)
        self._last = 0.0
        self._bar: Progress | None = None
        if not quiet and not self.json and self.err.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]generate"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=self.err,
            )
            self._task = self._bar.add_task("generate", total=total or None, detail="")
            self._bar.start()

    def event(self, event: str, level: str = "info", **fields: Any) -> None:
        """One log event (text or JSON on stderr); errors are shown even when quiet."""
        if self.quiet and level != "error":
            return
        if self.json:
            line = {"ts": round(time.time(), 3), "level": level, "event": event, **fields}
            print(json.dumps(line, default=str), file=sys.stderr, flush=True)
        else:
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            # verbatim: no markup (a path may hold "[/b]"), no wrapping into a cron log
            print(f"{level}: {event} {detail}".rstrip(), file=sys.stderr, flush=True)

    def due(self) -> bool:
        """Whether an `update` now would show anything: the bar redraws at most `BAR_S` apart,
        log lines come every `interval_s`, a quiet job shows none. A job asks before it gathers
        the figures, so a million short requests do not gather them a million times."""
        if self._bar is None and self.quiet:
            return False
        wait = BAR_S if self._bar is not None else self.interval_s
        return time.monotonic() - self._last >= wait

    def update(self, done: int, **stats: Any) -> None:
        """Called as requests finish; the bar redraws, log lines come every `interval_s`."""
        if self._bar is not None:
            self._last = time.monotonic()
            swapped = f"  swapped {stats['swapped']}" if "swapped" in stats else ""
            detail = (
                f"{stats['out_tok_s']:.0f} tok/s  running {stats['running']}  waiting "
                f"{stats['waiting']}{swapped}  KV {stats['kv_usage']:.0%}  preempted "
                f"{stats['preemptions']}"
            )
            self._bar.update(self._task, completed=done, detail=detail)
            return
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self.event("progress", done=done, **stats)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
