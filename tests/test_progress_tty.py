"""The terminal bar of `generate` and the log lines around it, on a real pseudo-terminal: a line
logged while the bar is live is printed above it, whole, never into the bar's line."""

from __future__ import annotations

import os
import re
import select
import sys

import pytest

pty = pytest.importorskip("pty")

CHILD = """
import logging, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
log = logging.getLogger("pagedctl.engine")
log.info("before the bar: CPU threads: 2")
from pagedctl.generate.progress import Reporter
stats = dict(out_tok_s=1.0, running=1, waiting=0, kv_usage=0.1, preemptions=0)
report = Reporter(3, quiet=False, log_format="text")
for done in range(3):
    report.update(done, **stats)
    time.sleep(0.3)  # the bar is drawn, its cursor at the end of its line
    log.info("model m (LlamaForCausalLM, float32, cpu); KV cache: %d blocks", done)
report.update(3, **stats)
time.sleep(0.3)
report.close()
log.info("after the bar")
"""


def _screen(raw: str) -> list[str]:
    """What a terminal shows for `raw`: carriage returns, line feeds, erase-line, cursor-up;
    colours and other escapes dropped."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
            lines += [""] * (row + 1 - len(lines))
        elif token.startswith("\x1b["):
            if token.endswith("K"):
                lines[row] = lines[row][:col] if token == "\x1b[K" else ""
            elif token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + 1 :]
            col += 1
    return [line.rstrip() for line in lines]


def test_log_lines_print_above_a_live_bar_whole() -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the bar on a terminal of 100 columns
        os.environ.update(TERM="xterm-256color", COLUMNS="100", LINES="40")
        os.execv(sys.executable, [sys.executable, "-c", CHILD])
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 30)
        try:
            data = os.read(fd, 1 << 16) if ready else b""
        except OSError:  # the child closed the terminal
            data = b""
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    screen = [line for line in _screen(out.decode()) if line]
    model = "INFO pagedctl.engine: model m (LlamaForCausalLM, float32, cpu); KV cache:"
    logged = [f"{model} {i} blocks" for i in range(3)]
    assert screen[0] == "INFO pagedctl.engine: before the bar: CPU threads: 2"
    assert screen[1:4] == logged, screen
    assert screen[4].startswith("generate") and "3/3" in screen[4], screen
    assert screen[5:] == ["INFO pagedctl.engine: after the bar"], screen


def test_the_screen_model_sees_a_line_written_into_the_bar() -> None:
    """The check above can fail: a log line written straight after the bar joins its line."""
    raw = "\r\x1b[2Kgenerate 1/3\x1b[0mINFO x: model\r\n\r\x1b[2Kgenerate 2/3"
    assert _screen(raw) == ["generate 1/3INFO x: model", "generate 2/3"]
