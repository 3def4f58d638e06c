"""The requests a point runs: drawn at random, sharing a prefix, or read from a `generate` file."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagedctl.recipe_file import RecipeError
from pagedctl.sweep.settings import DEFAULT_WORKLOAD, WORKLOAD_KINDS, parse_length

logger = logging.getLogger("pagedctl.sweep")  # one logger, one name, for the whole package
WARMUP_REQUESTS, WARMUP_TOKENS = 256, 8


@dataclass
class Workload:
    """Engine inputs of one run, and the ones run untimed before it (`prime`)."""

    requests: list[dict]
    prime: list[dict] = field(default_factory=list)
    skipped_lines: int = 0

    def warmup(self) -> list[dict]:
        """The requests (the first 256), answers cut to 8 tokens: the run's batch widths, prompt
        lengths and prefix hits, so that compilation and first-use allocations happen untimed."""
        out = []
        for i, req in enumerate(self.requests[:WARMUP_REQUESTS]):
            params = req["sampling_params"]
            params = replace(params, max_tokens=min(params.max_tokens, WARMUP_TOKENS))
            out.append({**req, "request_id": f"warmup-{i}", "sampling_params": params})
        return out


def build_workload(spec: dict[str, Any], vocab_size: int, cache: dict | None = None) -> Workload:
    """Draw (or read) the requests that `spec` describes; `cache` keeps read files."""
    kind = spec.get("kind", "random")
    if kind == "random":
        spec = {**DEFAULT_WORKLOAD, **spec}
    unknown = sorted(k for k in spec if k != "kind" and k not in WORKLOAD_KINDS[kind])
    if unknown:
        raise RecipeError(f"workload keys {unknown} do not apply to a {kind} workload")
    if kind == "file":
        return _file_workload(spec, cache if cache is not None else {})
    lo, hi = parse_length("workload", "token_ids", spec.get("token_ids") or [0, 10000])
    token_ids = (lo, max(lo + 1, min(hi, vocab_size)))
    if kind == "random":
        return _random_workload(spec, token_ids)
    return _shared_prefix_workload(spec, token_ids)


def _params(spec: dict, max_tokens: int):
    from pagedctl.engine import SamplingParams

    temperature = spec.get("temperature")
    return SamplingParams(
        n=int(spec.get("n") or 1),
        temperature=0.6 if temperature is None else float(temperature),  # nano-bench's
        max_tokens=max_tokens,
        ignore_eos=True,
    )


def _random_workload(spec: dict, token_ids: tuple[int, int]) -> Workload:
    """nano-bench's generator (shared with `pagedctl bench`): prompts first, then output lengths."""
    from pagedctl.bench.recipe import WorkloadSpec, make_workload

    wl = make_workload(
        WorkloadSpec(
            num_requests=int(spec.get("num_requests") or 1),
            prompt_len=parse_length("workload", "prompt_len", spec["prompt_len"]),
            output_len=parse_length("workload", "output_len", spec["output_len"]),
            token_ids=token_ids,
            seed=int(spec.get("seed") or 0),
        )
    )
    requests = [
        {"request_id": f"r{i}", "prompt_token_ids": ids, "sampling_params": _params(spec, mt)}
        for i, (ids, mt) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True))
    ]
    return Workload(requests)


def _shared_prefix_workload(spec: dict, token_ids: tuple[int, int]) -> Workload:
    """Requests that begin with one random prefix, each with its own random suffix (maybe none).

    `prime`: one request of the prefix alone runs untimed first, so the prefix is already in the
    pool when the timed requests arrive (with the prefix cache on).
    """
    rng = random.Random(int(spec.get("seed") or 0))
    lo, hi = token_ids
    if "prefix_len" not in spec or "output_len" not in spec:
        raise RecipeError("a shared_prefix workload needs prefix_len and output_len")
    prefix = [rng.randrange(lo, hi) for _ in range(parse_length("workload", "prefix_len",
                                                           spec["prefix_len"])[0])]  # fmt: skip
    suffix_len = parse_length("workload", "suffix_len", spec.get("suffix_len") or 0)[0]
    out_lo, out_hi = parse_length("workload", "output_len", spec["output_len"])
    requests = []
    for i in range(int(spec.get("num_requests") or 1)):
        ids = prefix + [rng.randrange(lo, hi) for _ in range(suffix_len)]
        params = _params(spec, rng.randint(out_lo, out_hi))
        requests.append({"request_id": f"r{i}", "prompt_token_ids": ids, "sampling_params": params})
    prime = []
    if spec.get("prime"):
        params = replace(_params(spec, 1), n=1)
        prime = [{"request_id": "prime", "prompt_token_ids": prefix, "sampling_params": params}]
    return Workload(requests, prime)


def _file_workload(spec: dict, cache: dict) -> Workload:
    """A `generate` input file (both line formats, beam-search lines too); bad lines are
    counted and left out."""
    from pagedctl.generate.job import engine_input
    from pagedctl.generate.reader import LineError, ReaderLimits, read_requests

    key = (spec["input"], spec.get("max_tokens"), spec.get("temperature"), spec.get("ignore_eos"))
    if key in cache:
        return cache[key]
    path = Path(spec["input"])
    if not path.is_file():
        raise RecipeError(f"input {path} is not a file")
    limits = ReaderLimits(max_tokens_limit=2**30, default_max_tokens=spec.get("max_tokens") or 256)
    defaults = {k: spec[k] for k in ("temperature", "ignore_eos") if spec.get(k) is not None}
    requests, skipped = [], 0
    for item in read_requests(path, limits):
        if isinstance(item, LineError):
            skipped += 1
            logger.warning("%s line %d left out: %s", path, item.line_no, item.message)
            continue
        req = engine_input(item, defaults)
        if spec.get("ignore_eos") is not None:  # the flag wins over the line
            req["sampling_params"] = replace(req["sampling_params"], ignore_eos=spec["ignore_eos"])
        requests.append(req)
    if not requests:
        raise RecipeError(f"no valid request in {path} ({skipped} bad lines)")
    cache[key] = Workload(requests, skipped_lines=skipped)
    return cache[key]
