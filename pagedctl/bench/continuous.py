"""The hf-continuous peer of `pagedctl bench`: transformers continuous batching.

A paged cache with CUDA graphs where available, driven through
`continuous_batching_context_manager`, the machinery under `generate_batch`, so that each request
carries its own `max_new_tokens` (`generate_batch` takes one for all). EOS is disabled (id -1).
Set-up (the cache, its warm-up and graph capture) is timed apart; `time_limit_s` ends the measured
pass early, leaving unfinished requests uncounted.

Without psutil (not a dependency of pagedctl), transformers' CPU memory query logs an ERROR and
its host swap-pool sizing a WARNING, although the CPU recipes size the cache themselves
(`num_blocks`, `max_batch_tokens`), host offloading is off (`cpu_offload_space` 0, its default)
and the query falls back to the memory of the process's NUMA nodes: those notes are dropped while
the peer runs, and nothing else is (`_without_psutil_notes`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pagedctl.bench.peers import SideRun, hf_config, hf_peer_model, sampling_kwargs
from pagedctl.bench.recipe import BenchRecipe, Workload


def _cb_config(settings: dict, device: torch.device, seed: int):
    """A ContinuousBatchingConfig from the recipe, across 5.x renames (block_size -> page_size)."""
    from transformers.generation import ContinuousBatchingConfig

    fields = set(ContinuousBatchingConfig.__dataclass_fields__)
    kwargs: dict[str, Any] = {"page_size" if "page_size" in fields else "block_size": 256}
    if "page_size" in settings:
        kwargs[next(iter(kwargs))] = int(settings["page_size"])
    for key in ("num_blocks", "max_batch_tokens", "max_memory_percent"):
        if settings.get(key) is not None:
            kwargs[key] = settings[key]
    kwargs["use_cuda_graph"] = device.type == "cuda" and settings.get("use_cuda_graph", True)
    if "seed" in fields:
        kwargs["seed"] = seed
    return ContinuousBatchingConfig(**kwargs), kwargs


def _workload_hints(wl: Workload) -> dict:
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return {}
    hints = WorkloadHints(
        max_prompt_length=max(map(len, wl.prompts)),
        max_generated_length=max(wl.max_tokens),
        num_requests=len(wl.prompts),
    )
    return {"workload_hints": hints}


def _cb_logger() -> logging.Logger:
    """The logger of transformers' continuous batching (a top-level one, outside `transformers`)."""
    try:
        from transformers.generation.continuous_batching.utils import logger
    except ImportError:
        return logging.getLogger("ContinuousBatchingLogger")
    return logger


class _PsutilNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


@contextmanager
def _without_psutil_notes() -> Iterator[None]:
    """While entered, continuous batching's log loses its lines about psutil not being installed."""
    logger, note = _cb_logger(), _PsutilNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def run_hf_continuous(recipe: BenchRecipe, wl: Workload, settings: dict) -> SideRun:
    """Continuous batching: requests added one by one with their own max_new_tokens."""
    with _without_psutil_notes():
        return _run(recipe, wl, settings)


def _run(recipe: BenchRecipe, wl: Workload, settings: dict) -> SideRun:
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    model = hf_peer_model(recipe, settings)
    cb, cb_kwargs = _cb_config(settings, model.device, recipe.seed)
    gen = GenerationConfig(
        max_new_tokens=max(wl.max_tokens), eos_token_id=-1, **sampling_kwargs(wl.temperature)
    )
    limit = settings.get("time_limit_s")
    cm = model.continuous_batching_context_manager(
        generation_config=gen,
        continuous_batching_config=cb,
        block=True,
        timeout=30,
        **_workload_hints(wl),
    )
    manager = cm.__enter__()  # builds the cache, warms up and captures the CUDA graphs
    try:
        attention = model.config._attn_implementation  # as switched for paged attention
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = _collect(manager, wl, t0 + limit if limit else None)
        wall = time.perf_counter() - t0
    finally:
        cm.__exit__(None, None, None)
    failed = [r.error for r in results if r is not None and r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {failed[0]}")
    counts = [len(r.generated_tokens) if r is not None else None for r in results]
    config = hf_config(model, {"time_limit_s": limit} if limit else {}, cb_kwargs)
    config["attention"] = attention
    return SideRun(config, setup, wall, counts, sum(c or 0 for c in counts))


def _collect(manager, wl: Workload, deadline: float | None) -> list:
    for i, (prompt, m) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
    done: dict[str, Any] = {}
    while len(done) < len(wl.prompts):
        if deadline is not None and time.perf_counter() > deadline:
            break
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"the generation thread stopped after {len(done)} requests")
            continue
        if result.is_finished():
            done[result.request_id] = result
    return [done.get(f"r{i}") for i in range(len(wl.prompts))]
