"""How a job ends early: `JobExit` (an exit code and one line), `JobStopped` (a signal before
the first request), and which errors of a file are the command's fault, the disk's, or a full
disk's."""

from __future__ import annotations

import errno
import signal

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
