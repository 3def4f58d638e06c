"""Sequence lengths: a named distribution, or the requests of a JSONL job (and what they produced).

Every source reduces to pairs (prompt tokens, output tokens). A distribution's draw is the whole
sequence, counted as output (a sequence then lives one step per token, as in the simulation
behind the T4 figures that `recipes/capacity-t4.yaml` compares against); a job's prompts are
tokenized and its outputs are `max_tokens`, or what an earlier `pagedctl generate` run of the same
file really produced.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_DIST_HELP = (
    "lognormal:mean=M,median=D | lognormal:median=D,sigma=S | lognormal:mu=U,sigma=S | "
    "uniform:min=A,max=B | exponential:mean=M | fixed:N"
)
BYTES_PER_TOKEN_GUESS = 4  # text without a tokenizer: about 4 UTF-8 bytes per BPE token
CHAT_OVERHEAD_GUESS = 4  # tokens a chat template adds per message, without a tokenizer


class LengthsError(ValueError):
    """Lengths cannot be read from what was given; the message says why."""


@dataclass(frozen=True)
class Distribution:
    """A continuous length distribution; a drawn length is ceil(x), at least 1."""

    spec: str
    kind: str
    params: dict[str, float]

    def cdf(self, x: np.ndarray) -> np.ndarray:
        """P(X <= x) for an array of x >= 0."""
        p = self.params
        x = np.asarray(x, dtype=np.float64)
        if self.kind == "lognormal":
            z = (np.log(np.maximum(x, 1e-300)) - p["mu"]) / (p["sigma"] * math.sqrt(2))
            return np.where(x > 0, 0.5 * (1 + _erf(z)), 0.0)
        if self.kind == "uniform":
            return np.clip((x - p["min"]) / (p["max"] - p["min"]), 0.0, 1.0)
        if self.kind == "exponential":
            return np.where(x > 0, 1 - np.exp(-x / p["mean"]), 0.0)
        return (x >= p["value"]).astype(np.float64)  # fixed

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        p = self.params
        if self.kind == "lognormal":
            x = rng.lognormal(p["mu"], p["sigma"], n)
        elif self.kind == "uniform":
            x = rng.uniform(p["min"], p["max"], n)
        elif self.kind == "exponential":
            x = rng.exponential(p["mean"], n)
        else:
            x = np.full(n, p["value"])
        return np.maximum(np.ceil(x), 1).astype(np.int64)


def _erf(z: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(z)


def parse_distribution(spec: str) -> Distribution:
    """Read `kind:key=value,...` (see `_DIST_HELP`)."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip().lower()
    try:
        if kind == "fixed":
            value = float(rest.split("=")[-1])
            args: dict[str, float] = {"value": value}
        else:
            args = {k.strip(): float(v) for k, v in (kv.split("=") for kv in rest.split(","))}
    except ValueError:
        raise LengthsError(f"cannot read --dist {spec!r}; use {_DIST_HELP}") from None
    if any(not math.isfinite(v) or v <= 0 for v in args.values()):
        raise LengthsError(f"--dist {spec!r}: every parameter must be a positive number")
    params = _params(kind, args, spec)
    return Distribution(spec, kind, params)


def _params(kind: str, a: dict[str, float], spec: str) -> dict[str, float]:
    keys = set(a)
    if kind == "lognormal":
        if keys == {"mean", "median"}:
            if a["mean"] <= a["median"]:
                raise LengthsError(f"--dist {spec!r}: a lognormal's mean exceeds its median")
            return {
                "mu": math.log(a["median"]),
                "sigma": math.sqrt(2 * math.log(a["mean"] / a["median"])),
            }
        if keys == {"median", "sigma"}:
            return {"mu": math.log(a["median"]), "sigma": a["sigma"]}
        if keys == {"mu", "sigma"}:
            return a
    uniform = kind == "uniform" and keys == {"min", "max"} and a["min"] < a["max"]
    if uniform or (kind == "exponential" and keys == {"mean"}) or kind == "fixed":
        return a
    raise LengthsError(f"cannot read --dist {spec!r}; use {_DIST_HELP}")


@dataclass(frozen=True)
class Lengths:
    """Where sequence lengths come from, cut to `max_len`.

    Attributes:
        source: a description for the reports.
        max_len: longest sequence (prompt + output).
        dist: the distribution, or None for a job's requests.
        prompt, output: per-sequence tokens (a job's requests), None for a distribution.
        notes: caveats (estimated token counts, requests left out).
    """

    source: str
    max_len: int
    dist: Distribution | None = None
    prompt: np.ndarray | None = None
    output: np.ndarray | None = None
    notes: tuple[str, ...] = ()

    def pmf(self) -> np.ndarray:
        """P(length = n) for n = 0..max_len (index 0 is always 0)."""
        if self.dist is not None:
            edges = np.arange(self.max_len + 1, dtype=np.float64)
            cdf = self.dist.cdf(edges)
            cdf[0] = 0.0  # a length is at least 1
            cdf[-1] = 1.0  # longer draws stop at max_len
            return np.diff(cdf, prepend=0.0)
        totals = self.prompt + self.output
        return np.bincount(totals, minlength=self.max_len + 1) / len(totals)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(footprint tokens, lifetime steps) of `n` sequences drawn from this source."""
        if self.dist is not None:
            total = np.minimum(self.dist.draw(n, rng), self.max_len)
            return total, total.astype(np.float64)
        idx = rng.integers(0, len(self.prompt), n)
        out = self.output[idx]
        return self.prompt[idx] + out, np.maximum(out, 1).astype(np.float64)

    @property
    def num_sequences(self) -> int | None:
        return None if self.prompt is None else len(self.prompt)


def from_distribution(spec: str, max_len: int) -> Lengths:
    dist = parse_distribution(spec)
    return Lengths(f"--dist {spec}", max_len, dist=dist)


def from_jobs(
    path: Path,
    max_len: int,
    tokenizer_dir: Path | None,
    outputs: Path | None = None,
    default_max_tokens: int = 256,
) -> Lengths:
    """Lengths of the requests in a `generate` input file (and of what an earlier run produced).

    Prompts are tokenized with the model's tokenizer (chat messages through its template), or,
    without one, estimated at 4 UTF-8 bytes per token. A request with `n` samples counts as `n`
    sequences (the engine would share their prompt; that sharing is not counted here).
    """
    from pagedctl.generate.reader import JobRequest, ReaderLimits, read_requests

    limits = ReaderLimits(max_tokens_limit=2**31 - 1, default_max_tokens=default_max_tokens)
    produced = _read_outputs(outputs) if outputs else {}
    counter = _Counter(tokenizer_dir)
    p_list: list[int] = []
    o_list: list[int] = []
    seen = bad = from_run = too_long = 0
    chunk: list = []
    try:
        for item in read_requests(path, limits):
            if not isinstance(item, JobRequest):
                bad += 1
                continue
            seen += 1
            if item.custom_id in produced:  # the run said how long it was: nothing to tokenize
                from_run += 1
                plen, outs = produced[item.custom_id]
                too_long += _add(p_list, o_list, plen, outs, max_len)
                continue
            chunk.append(item)
            if len(chunk) == _CHUNK:
                too_long += _add_chunk(p_list, o_list, chunk, counter, max_len)
                chunk = []
    except OSError as e:
        raise LengthsError(f"cannot read --lengths {path}: {e}") from None
    too_long += _add_chunk(p_list, o_list, chunk, counter, max_len)
    if not seen:
        raise LengthsError(f"--lengths {path}: no valid request lines")
    notes = [f"{bad} invalid lines of {path.name} left out"] if bad else []
    notes += counter.notes
    if outputs:
        notes.append(f"{from_run} of {seen} requests took their lengths from {outputs.name}")
    if too_long:
        notes.append(f"{too_long} requests with prompts of --max-len or more left out")
    if not p_list:
        raise LengthsError(f"--lengths {path}: no request fits in --max-len {max_len}")
    src = f"--lengths {path.name}" + (f" + --outputs {outputs.name}" if outputs else "")
    prompt = np.asarray(p_list, dtype=np.int64)
    output = np.asarray(o_list, dtype=np.int64)
    return Lengths(src, max_len, prompt=prompt, output=output, notes=tuple(notes))


_CHUNK = 1024  # requests tokenized together; the file is never held in memory at once


def _add(p_list: list, o_list: list, plen: int, outs: list[int], max_len: int) -> int:
    """Append one request's sequences; 1 if its prompt leaves no room (left out), else 0."""
    if plen >= max_len:
        return 1
    for o in outs:
        p_list.append(plen)
        o_list.append(max(min(o, max_len - plen), 0))
    return 0


def _add_chunk(p_list: list, o_list: list, chunk: list, counter: _Counter, max_len: int) -> int:
    left_out = 0
    for req, plen in zip(chunk, counter.prompt_lengths(chunk), strict=True):
        outs = [int(req.sampling["max_tokens"])] * int(req.sampling.get("n", 1))
        left_out += _add(p_list, o_list, plen, outs, max_len)
    return left_out


class _Counter:
    """Prompt tokens of requests: the model's tokenizer (chat messages through its template),
    or an estimate when there is none; `notes` says which."""

    def __init__(self, tokenizer_dir: Path | None) -> None:
        self.tok = None
        self.notes: list[str] = []
        if tokenizer_dir is None:
            self.notes.append("no tokenizer: prompt tokens estimated at 4 UTF-8 bytes per token")
            return
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        self.template = bool(getattr(self.tok, "chat_template", None))

    def prompt_lengths(self, reqs: list) -> list[int]:
        if self.tok is None:
            return [_guess(r) for r in reqs]
        out: list[int] = []
        texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for r in reqs:
            out.append(0)
            if r.prompt_token_ids is not None:
                out[-1] = len(r.prompt_token_ids)
            elif r.messages is not None and not self.template:
                out[-1] = _guess(r)
                note = "the tokenizer has no chat template: chat prompts estimated"
                if note not in self.notes:
                    self.notes.append(note)
            elif r.messages is not None:
                text = self.tok.apply_chat_template(
                    r.messages, tokenize=False, add_generation_prompt=True
                )
                texts[False].append((len(out) - 1, text))
            else:
                texts[True].append((len(out) - 1, r.prompt))
        for special, items in texts.items():
            if items:
                ids = self.tok([t for _, t in items], add_special_tokens=special)["input_ids"]
                for (slot, _), row in zip(items, ids, strict=True):
                    out[slot] = len(row)
        return out


def _guess(req) -> int:
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    if req.messages is not None:
        text = "".join(str(m.get("content") or "") for m in req.messages)
        extra = CHAT_OVERHEAD_GUESS * len(req.messages)
    else:
        text, extra = req.prompt, 0
    return max(math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_GUESS), 1) + extra


def _read_outputs(path: Path) -> dict[str, tuple[int, list[int]]]:
    """custom_id -> (prompt tokens, output tokens per sample) from a `generate` output file."""
    found: dict[str, tuple[int, list[int]]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LengthsError(f"cannot read --outputs {path}: {e}") from None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            body = (rec.get("response") or {}).get("body") or {}
            usage = body.get("usage")
            if rec.get("error") or not usage:
                continue
            n = max(len(body.get("choices") or [None]), 1)
            per = round(int(usage["completion_tokens"]) / n)
            found[str(rec["custom_id"])] = (int(usage["prompt_tokens"]), [per] * n)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise LengthsError(
                f"--outputs {path}:{line_no} is not a pagedctl generate output line"
            ) from None
    return found
