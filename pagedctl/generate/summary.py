"""The summary of a `generate` run: the engines' figures gathered into the summary's sections.

One engine's `LLM.snapshot()` or each replica's latest (`Engine.snapshots`); counters summed
across replicas; the `beam_search` and `swap` sections only where the run had any, the replica
table where the engine has one, the start-up where it had one of its own.
"""

from __future__ import annotations

import time
from typing import Any

from pagedctl.engine import Engine, Replicas


def combined_stats(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """`LLM.stats` of several engines as one: counters summed, the hit rate over the sum, a
    setting (the preemption mode, auto's costs) from the first."""
    if len(snaps) == 1:
        return snaps[0]["stats"]
    out: dict[str, Any] = {}
    for part, empty in _NO_STATS.items():
        merged: dict[str, Any] = dict(empty) if not snaps else {}
        for snap in snaps:
            for key, value in snap["stats"][part].items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
                else:
                    merged.setdefault(key, value)
        out[part] = merged
    cache = out["prefix_cache"]
    queried = cache.get("queried_tokens", 0)
    cache["hit_rate"] = cache.get("hit_tokens", 0) / queried if queried else 0.0
    return out


# What a scaled-out job whose replicas returned nothing reports.
_NO_STATS: dict[str, dict[str, Any]] = {
    "scheduler": {"num_preemptions": 0, "num_recomputed_tokens": 0},
    "prefix_cache": {"queried_tokens": 0, "hit_tokens": 0},
    "beam_search": {"num_groups": 0},
    "swap": {"preemption_mode": "recompute", "swap_outs": 0},
}


def replicas_ready_s(snaps: list[dict[str, Any]], replicas: int, wall: float) -> float | None:
    """Seconds from the start of the run until `replicas` replicas had loaded (their model
    loads inside the run's wall, where a one-process job's is before it); None if fewer ever
    reported."""
    ready = sorted(s["ready_at"] for s in snaps if "ready_at" in s)
    if len(ready) < replicas:
        return None
    return round(ready[replicas - 1] - (time.time() - wall), 3)


def replica_summary(
    replicas: Replicas | None, snaps: list[dict[str, Any]], wall: float
) -> dict[str, Any]:
    """Per replica, by name: the requests it returned, their output tokens, its rate over the
    run and its preemptions; the deaths charged and when all had loaded. Nothing for an
    engine that is one process."""
    if replicas is None:
        return {}
    table = [
        {
            "replica": share.name,
            "requests": share.requests,
            "output_tokens": share.output_tokens,
            "output_tok_per_s": round(share.output_tokens / wall, 2) if wall else 0.0,
            "preemptions": share.preemptions,
        }
        for share in sorted(replicas.shares(), key=lambda share: share.name)
    ]
    return {
        "replicas": table,
        "replica_deaths": replicas.deaths(),
        "replicas_ready_s": replicas_ready_s(snaps, replicas.size, wall),
    }


def replica_progress(replicas: Replicas | None) -> dict[str, Any]:
    """A progress line's `replicas` figure (the requests each returned): none for an engine
    that is one process."""
    if replicas is None:
        return {}
    return {"replicas": {share.name: share.requests for share in replicas.shares()}}


def beam_summary(beams: dict[str, int]) -> dict[str, Any]:
    """The summary's `beam_search` figures from the engine's (`llm.stats["beam_search"]`): none
    when no beam search ended in the run."""
    if not beams["num_groups"]:
        return {}
    peak, unshared = beams["peak_blocks"], beams["peak_blocks_unshared"]
    return {
        "beam_search": {
            "requests": beams["num_groups"],
            "peak_blocks": peak,
            "peak_blocks_unshared": unshared,
            "shared_saving": round(1 - peak / unshared, 4) if unshared else 0.0,
            "cow_copies": beams["num_cow_copies"],
        }
    }


def swap_summary(swap: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    """The summary's `swap` figures from the engine's (`llm.stats["swap"]`, `llm.memory`): none
    under the default `recompute`, where nothing is ever swapped."""
    if swap["preemption_mode"] == "recompute" and not swap["swap_outs"]:
        return {}
    return {
        "swap": {
            "preemption_mode": swap["preemption_mode"],
            "host_blocks": swap["num_host_blocks"],
            "host_bytes": memory["swap_space_bytes"],
            "swap_outs": swap["swap_outs"],
            "swap_ins": swap["swap_ins"],
            "blocks_out": swap["blocks_out"],
            "blocks_in": swap["blocks_in"],
            "bytes_moved": swap["bytes_moved"],
            "transfer_s": round(swap["transfer_s"], 4),
            "fallbacks_to_recompute": swap["fallbacks_to_recompute"],
            **({"costs": swap["costs"]} if swap["costs"] else {}),  # what auto decided from
        }
    }


def run_summary(engine: Engine, counts, wall: float) -> dict[str, Any]:
    """A run's figures for the summary: throughput over `wall` seconds of `counts` (the job's
    JobCounts), the engines' scheduler, cache, beam and swap figures, each replica's share
    (where the engine has replicas) or the engine's start-up (where it had its own)."""
    c, snaps = counts, engine.snapshots()
    stats = combined_stats(snaps)
    memory = {"swap_space_bytes": sum(s["memory"].get("swap_space_bytes", 0) for s in snaps)}
    startup = engine.startup
    return {
        "prompt_tokens": c.prompt_tokens,
        "output_tokens": c.output_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": _per_s(c.ok + c.failed, wall, 3),
        "output_tok_per_s": _per_s(c.output_tokens, wall),
        "total_tok_per_s": _per_s(c.prompt_tokens + c.output_tokens, wall),
        "preemptions": stats["scheduler"]["num_preemptions"],
        "recomputed_tokens": stats["scheduler"]["num_recomputed_tokens"],
        "prefix_cache_hit_rate": round(stats["prefix_cache"]["hit_rate"], 4),
        "peak_kv_usage": round(max((s["peak_kv_usage"] for s in snaps), default=0.0), 4),
        **beam_summary(stats["beam_search"]),
        **swap_summary(stats["swap"], memory),
        **replica_summary(engine.replicas, snaps, wall),
        **({"startup": startup} if startup is not None else {}),
    }


def _per_s(count: int, wall: float, digits: int = 2) -> float:
    return round(count / wall, digits) if wall else 0.0
