"""How a job ends early: `JobExit` (an exit code and one line), `JobStopped` (a signal before
the first request), `StopSignals` (SIGTERM and SIGINT as a job takes them), and which errors of a
file are the command's fault, the disk's, or a full disk's."""

from __future__ import annotations

import contextlib
import errno
import signal
from collections.abc import Iterator
from typing import Any

from pagedctl.exits import EXIT_SIGINT, EXIT_TEMPFAIL


class JobExit(Exception):
    """Ends the job with an exit code and a message (the command prints it)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class JobStopped(BaseException):
    """SIGTERM or SIGINT before the first request: raised from the handler (a model load can take
    minutes and cannot look at a flag), and, like KeyboardInterrupt, not caught as an error."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} before the first request: rerun the same command")
        self.code = stop_code(signum)


def stop_code(signum: int) -> int:
    return EXIT_SIGINT if signum == signal.SIGINT else EXIT_TEMPFAIL


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT as a job takes them. Before it is `graceful` (the model loading) a
    signal raises JobStopped; from then on it is kept in `signum`, admission stops and every
    record is written; a second SIGINT raises KeyboardInterrupt (stop now)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.graceful = False
        self._saved: dict[int, Any] | None = None  # the handlers to restore, while handled

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """The signals handled here inside the block (nested blocks share one); the handlers
        before it are restored after."""
        if self._saved is not None:
            yield
            return
        self._saved = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
            self._saved = None

    def take_back(self) -> None:
        """Handle them here again after a library set its own handlers (Ray's start-up sets
        SIGTERM's), if inside `handled`."""
        if self._saved is not None:
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        if not self.graceful:
            raise JobStopped(signum)

    @property
    def name(self) -> str | None:
        """The signal's name (SIGTERM) once one came, else None."""
        return signal.Signals(self.signum).name if self.signum is not None else None


# The errors of a path that cannot be used as it is given: the command must change (64). A full
# disk is "retry later" (75); any other error is the disk's (74).
PATH_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENOENT,
    errno.ENAMETOOLONG,
    errno.ELOOP,
    errno.EEXIST,
}
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
