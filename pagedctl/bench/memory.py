"""Memory of a long `generate` job: RSS growth over a 200,000-line input, sampled while it runs.

The input (prompt token ids, two output tokens each) is written to a temporary folder and run in
this process through the same `GenerateJob` as the command, with the dummy-weight `tiny-llama`
preset so that the figure is the job's own bookkeeping, not a model's weights or activations.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

from pagedctl.generate.job import GenerateJob
from pagedctl.generate.recipe import JobSettings


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler(threading.Thread):
    """Samples this process's RSS every `interval_s` and keeps the peak."""

    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.peak, self._halt = interval_s, _rss_bytes(), threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.peak = max(self.peak, _rss_bytes())

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return max(self.peak, _rss_bytes())


def write_input(path: Path, lines: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(lines):
            ids = [rng.randrange(3, 512) for _ in range(rng.randint(8, 48))]
            f.write(
                json.dumps({"custom_id": f"m{i:07d}", "prompt_token_ids": ids, "max_tokens": 2})
                + "\n"
            )


def run(lines: int = 200_000, model: str = "tiny-llama") -> dict:
    """Run the job; return RSS before it, at its peak and the growth, with the job's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        write_input(src, lines)
        settings = JobSettings(
            input=src,
            engine={
                "model": model,
                "device": "cpu",
                "kv_cache_memory_bytes": "64MiB",
                "max_num_seqs": 256,
            },
            sampling={"max_tokens": 2, "temperature": 0.0},
        )
        job = GenerateJob(settings, force=False, quiet=True, log_format="text")
        job.start_engine()  # the baseline already holds the model and the pool
        base = _rss_bytes()
        sampler = _Sampler()
        sampler.start()
        t0 = time.perf_counter()
        summary = job.run()
        wall = time.perf_counter() - t0
        peak = sampler.stop()
        out_lines = sum(1 for _ in (Path(tmp) / "in.out.jsonl").open())
    return {
        "lines": lines,
        "results_written": out_lines,
        "rss_before_job_mib": round(base / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_growth_mib": round((peak - base) / 2**20, 1),
        "target_growth_mib": 200,
        "wall_s": round(wall, 1),
        "summary": summary,
    }
