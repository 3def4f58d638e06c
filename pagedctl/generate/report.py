"""What a `generate` run prints and writes at its end: the summary table (this run beside the job
over all its runs), the JSON `summary` event, the summary file, and a spool folder's table."""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path

from rich.table import Table
from rich.text import Text

from pagedctl.console import stdout_console
from pagedctl.engine import format_bytes
from pagedctl.exits import EXIT_IOERR, EXIT_TEMPFAIL
from pagedctl.generate.errors import JobExit


def write_summary(summary: dict, path: Path) -> None:
    """Non-atomically, to the path as given (`/dev/stdout` included); records are all written."""
    try:
        path.write_text(json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise JobExit(
                EXIT_TEMPFAIL,
                f"the disk is full: cannot write the summary {path} ({e.strerror}); every record "
                "is written: free some space, then rerun the same command to write it",
            ) from None
        raise JobExit(
            EXIT_IOERR,
            f"cannot write the summary {path}: {e.strerror or e}; every record is written",
        ) from None


def report(summary: dict, path: Path | None, quiet: bool, log_format: str) -> None:
    """Print the summary, then write it to `path`: a summary file that cannot be written still
    leaves the summary in the log."""
    print_summary(summary, quiet, log_format)
    if path is not None:
        write_summary(summary, path)


def print_summary(summary: dict, quiet: bool, log_format: str) -> None:
    if log_format == "json":
        line = {"ts": round(time.time(), 3), "level": "info", "event": "summary", **summary}
        print(json.dumps(line, default=str), file=sys.stderr, flush=True)
        return
    if quiet:
        return
    table = Table(title="pagedctl generate")
    table.add_column("", style="bold")
    table.add_column("this run", justify="right", overflow="fold")  # a path folds, never "…"
    table.add_column("job (all runs)", justify="right", overflow="fold")
    for name, value, total in summary_rows(summary):
        table.add_row(name, Text(value), Text(total))  # verbatim: a path may hold "[/b]"
    stdout_console().print(table)


def summary_rows(summary: dict) -> list[tuple[str, str, str]]:
    """(what, this run, the job over all its runs) for each row of the summary table."""
    job = summary["job"]
    state = "complete" if job["complete"] else "not complete"
    rows = [
        (
            "requests (ok / failed / skipped)",
            "{requests} ({ok} / {failed} / {skipped_resumed})".format(**summary),
            "",
        ),
        (
            "records: results / errors",
            f"{summary['ok']:,} / {summary['failed']:,}",
            f"{job['results']:,} / {job['errors']:,} of {job['lines']:,} lines, {state}",
        ),
        ("  from earlier runs", "", f"{job['results_earlier']:,} / {job['errors_earlier']:,}"),
    ]
    if summary.get("interrupted_by"):
        rows.append(("interrupted by", summary["interrupted_by"], ""))
    if "wall_s" not in summary:  # stopped before the engine ran
        rows.append(("results / errors", f"{summary['output']} / {summary['errors']}", ""))
        return rows
    run = [
        ("prompt / output tokens", f"{summary['prompt_tokens']:,} / {summary['output_tokens']:,}"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("requests/s", f"{summary['requests_per_s']:.2f}"),
        (
            "output tok/s / total tok/s",
            f"{summary['output_tok_per_s']:.1f} / {summary['total_tok_per_s']:.1f}",
        ),
        (
            "preemptions / recomputed tokens",
            f"{summary['preemptions']} / {summary['recomputed_tokens']:,}",
        ),
        ("prefix-cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"),
        ("peak KV usage", f"{summary['peak_kv_usage']:.1%}"),
    ]
    if beams := summary.get("beam_search"):  # only when beam searches ran
        run.append(
            (
                "beam searches: peak blocks (unshared, saved) / copies",
                "{requests}: {peak_blocks:,} ({peak_blocks_unshared:,}, {shared_saving:.1%}) / "
                "{cow_copies:,}".format(**beams),
            )
        )
    if swap := summary.get("swap"):  # only when preemption may swap: under the preemptions
        moved = swap["blocks_out"] + swap["blocks_in"]
        at = 1 + next(i for i, (name, _) in enumerate(run) if name.startswith("preemptions"))
        run.insert(
            at,
            (
                f"swap ({swap['preemption_mode']}): out / in, blocks, time, fallbacks",
                f"{swap['swap_outs']:,} / {swap['swap_ins']:,}, {moved:,} "
                f"({format_bytes(swap['bytes_moved'])}), {swap['transfer_s']:.3f} s, "
                f"{swap['fallbacks_to_recompute']:,}",
            ),
        )
    if startup := summary.get("startup"):
        run.insert(2, ("start-up", startup_line(startup)))
    rows += [(name, value, "") for name, value in run]
    rows.append(("results / errors", f"{summary['output']} / {summary['errors']}", ""))
    return rows


def print_spool(rows: list[dict], log_format: str) -> None:
    """One line per input of a spool folder: what this run did with it."""
    if log_format == "json":
        for row in rows:
            line = {"ts": round(time.time(), 3), "level": "info", "event": "spool_file", **row}
            print(json.dumps(line, default=str), file=sys.stderr, flush=True)
        return
    table = Table(title="pagedctl generate: spool")
    for name in ("input", "status", "exit", "results", "errors", "output"):
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(str(row.get(k, ""))) for k in ("input", "status", "exit")),
                      Text(str(row.get("results", ""))), Text(str(row.get("errors", ""))),
                      Text(str(row.get("output", ""))))  # fmt: skip
    stdout_console().print(table)


def startup_line(startup: dict) -> str:
    """`12.3 s: import 3.1, load 1.0, ... (kernel JIT 4.2 s, 21 kernel variants)`: a summary's
    start-up phases, those under 0.05 s left out."""
    phases = [
        (k.removesuffix("_s"), v)
        for k, v in startup.items()
        if k.endswith("_s") and isinstance(v, int | float)
    ]
    phases = [(k, v) for k, v in phases if k not in ("engine", "compile")]
    total = sum(v for _, v in phases)
    phases = [(k, v) for k, v in phases if v >= 0.05] or phases[:1]  # the ones that cost
    line = f"{total:.1f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in phases)
    if startup.get("kernels_compiled"):
        line += (
            f" (kernel JIT {startup['compile_s']:.1f} s, "
            f"{startup['kernels_compiled']} kernel variants)"
        )
    return line
