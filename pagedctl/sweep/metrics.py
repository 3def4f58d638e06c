"""What a sweep measures: each metric's table header, format and meaning; the default columns."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One measured quantity: its table header, format and meaning; tables show it times
    `scale` (bytes as MiB), files as measured."""

    header: str
    fmt: str
    doc: str
    scale: float = 1.0


METRICS: dict[str, Metric] = {
    "requests": Metric("requests", ",.0f", "requests in the run"),
    "finished": Metric("finished", ",.0f", "requests that finished without an error"),
    "failed": Metric("failed", ",.0f", "requests refused or failed"),
    "prompt_tokens": Metric("prompt tok", ",.0f", "prompt tokens of the finished requests"),
    "output_tokens": Metric("output tok", ",.0f", "tokens generated, all samples"),
    "wall_s": Metric("wall s", ",.3f", "wall time of the run"),
    "requests_per_s": Metric("req/s", ",.2f", "finished requests per second"),
    "output_tok_s": Metric("out tok/s", ",.0f", "generated tokens per second"),
    "total_tok_s": Metric("total tok/s", ",.0f", "prompt + generated tokens per second"),
    "preemptions": Metric("preemptions", ",.0f", "sequences put back (recompute or swap)"),
    "recomputed_tokens": Metric("recomputed", ",.0f", "tokens computed again after preemption"),
    "recomputed_share": Metric("recomp. %", ".1%", "recomputed / all computed tokens"),
    "swap_outs": Metric("swap outs", ",.0f", "preemptions by swap: KV moved to the host pool"),
    "swap_ins": Metric("swap ins", ",.0f", "swapped-out sequences brought back from the host"),
    "swapped_blocks": Metric("swapped blocks", ",.0f", "KV blocks moved out and back in"),
    "swap_bytes": Metric("swap MiB", ",.1f", "KV bytes moved out and back in", 2**-20),
    "swap_s": Metric("swap s", ",.3f", "time the swap transfers took"),
    "swap_fallbacks": Metric(
        "swap fallbacks", ",.0f", "swaps the host pool could not take, recomputed instead"
    ),
    "prefill_tokens": Metric("prefill tok", ",.0f", "tokens computed in prefill (and recompute)"),
    "decode_tokens": Metric("decode tok", ",.0f", "tokens computed one at a time"),
    "prefix_hit_rate": Metric("prefix hit %", ".1%", "prefix-cache hits / tokens looked up"),
    "resumed_queried_tokens": Metric(
        "resumed asked", ",.0f", "tokens that preempted sequences looked up on coming back"
    ),
    "resumed_hit_tokens": Metric(
        "resumed cached", ",.0f", "of those, tokens found still in the prefix cache"
    ),
    "resumed_hit_share": Metric("resumed cached %", ".1%", "resumed cached / resumed asked"),
    "peak_kv_usage": Metric("peak KV %", ".1%", "most blocks held, sampled after each step"),
    "mean_kv_usage": Metric("mean KV %", ".1%", "blocks held, mean over steps"),
    "waste_slots": Metric(
        "waste slots", ",.0f", "allocated slots holding no token, mean over steps"
    ),
    "waste_share": Metric("waste %", ".1%", "waste slots / allocated slots, over all steps"),
    "tail_waste": Metric("tail waste tok", ",.1f", "empty slots of the last block, per sequence"),
    "steps": Metric("steps", ",.0f", "engine steps"),
    "first_ms": Metric("first ms", ",.1f", "sequential: the first request's latency (cold)"),
    "later_ms": Metric("again ms", ",.1f", "sequential: median latency of the later ones (warm)"),
}


# Beside the recomputation columns wherever a point preempts by swap (`with_swap_columns`).
SWAP_COLUMNS = ("swap_outs", "swapped_blocks", "swap_bytes", "swap_s", "swap_fallbacks")

DEFAULT_COLUMNS = (
    "output_tok_s",
    "total_tok_s",
    "requests_per_s",
    "wall_s",
    "preemptions",
    "recomputed_tokens",
    "recomputed_share",
    "prefix_hit_rate",
    "peak_kv_usage",
    "mean_kv_usage",
    "waste_share",
    "steps",
    "finished",
)


def fmt(metric: str, value: float | None) -> str:
    """A metric's value as its table shows it."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    m = METRICS[metric]
    return format(value * m.scale, m.fmt)


def with_swap_columns(columns: tuple[str, ...]) -> tuple[str, ...]:
    """`columns` with `SWAP_COLUMNS` after `recomputed_share` (or at the end), once each."""
    rest = tuple(c for c in columns if c not in SWAP_COLUMNS)
    at = rest.index("recomputed_share") + 1 if "recomputed_share" in rest else len(rest)
    return rest[:at] + SWAP_COLUMNS + rest[at:]
