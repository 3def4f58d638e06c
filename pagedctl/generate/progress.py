"""How a running job reports itself: a Rich bar on a terminal, periodic lines in a log, or nothing.

Log lines go to stderr, as text or (with `--log-format json`) one JSON object per line. While the
bar is live, every line meant for stderr, the logging module's included (the engine's, a
library's), is printed above the bar by the bar's console, never into it.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, TextIO

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
        self._last = -math.inf  # the first update shows, however long the machine has been up
        self._bar: Progress | None = None
        self._rerouted: list[tuple[logging.StreamHandler, TextIO]] = []
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
            self._rerouted = _start_above_logs(self._bar)

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
            for handler, stream in self._rerouted:
                handler.setStream(stream)
            self._bar.stop()
            self._bar = None


def _stderr_handlers(stream: TextIO) -> list[logging.StreamHandler]:
    """The logging handlers, of any logger, that write to `stream` (stderr): basicConfig's, and
    those a library set up for itself (torch's)."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {
        h
        for lg in loggers
        if isinstance(lg, logging.Logger)
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    }
    return [h for h in handlers if h.stream in (stream, sys.__stderr__)]


def _start_above_logs(bar: Progress) -> list[tuple[logging.StreamHandler, TextIO]]:
    """Start `bar` once every line written before it is out whole, then point the stderr log
    handlers at the bar's stand-in for stderr (Rich's, which prints each line above the bar);
    returns (handler, its stream) to put back."""
    stderr = sys.stderr
    handlers = _stderr_handlers(stderr)
    for handler in handlers:
        handler.flush()
    stderr.flush()
    bar.start()  # from here sys.stderr is Rich's proxy (on a terminal)
    if sys.stderr is stderr:
        return []
    return [(h, h.setStream(sys.stderr)) for h in handlers]
