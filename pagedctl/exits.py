"""The exit codes every pagedctl command uses (sysexits.h's where one fits), and what each means."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the work ran and failed: a benchmark side, every sweep point; or a bug of ours
EXIT_PARTIAL = 3
EXIT_USAGE = 64  # EX_USAGE
EXIT_DATAERR = 65  # EX_DATAERR
EXIT_IOERR = 74  # EX_IOERR
EXIT_TEMPFAIL = 75  # EX_TEMPFAIL
EXIT_SIGINT = 130  # 128 + SIGINT, as a shell reports it

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_FAILED: "the work ran and failed (a benchmark side, every sweep point), or an unexpected "
    "error",
    EXIT_PARTIAL: "generate: finished, some lines are in the errors file",
    EXIT_USAGE: "usage: a flag or recipe value that cannot be used (checked before anything is "
    "loaded or written), an output path that is a folder, not writable or not a results file, "
    "an unknown model, settings that differ from the manifest",
    EXIT_DATAERR: "the input is unusable as a whole: not a readable file, or no valid line; or a "
    "results file damaged in the middle",
    EXIT_IOERR: "an output could not be written part way (an I/O error other than a full disk); "
    "what was written is kept",
    EXIT_TEMPFAIL: "retry later: another run holds the lock, SIGTERM stopped this one, or the "
    "disk is full",
    EXIT_SIGINT: "interrupted by SIGINT (Ctrl-C); rerun to resume",
}
