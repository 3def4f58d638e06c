"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # as vLLM: a temperature under this samples greedily
MIN_MAX_TOKENS = 1  # the fewest output tokens a request may ask for (a job's lines, a sweep's)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request and when to stop it.

    `temperature == 0` means greedy. `n > 1` draws n samples from one prompt, whose KV is computed
    and stored once and shared by reference count (copy-on-write). `max_tokens` counts output
    tokens of each sample. `stop` strings are matched on detokenized text by the caller (the
    scheduler only sees token ids); `stop_token_ids` and EOS are matched by the scheduler.

    `strict_max_tokens`: refuse, rather than cut short, a request whose prompt plus `max_tokens`
    exceeds `max_model_len`, as OpenAI's API does (error code `context_length_exceeded`). Off, such
    a request runs and ends with finish reason "length", stop reason "max_model_len", when it
    reaches the limit.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    cache_salt: str | None = None
    strict_max_tokens: bool = False
    _stop_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "_stop_ids", frozenset(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "top_k", "max_tokens"):
            _require(name, getattr(self, name), int)
        for name in ("temperature", "top_p", "min_p"):
            _require(name, getattr(self, name), int | float)
        if self.seed is not None:
            _require("seed", self.seed, int)
        if not isinstance(self.strict_max_tokens, bool):
            raise TypeError(f"strict_max_tokens must be a bool, got {self.strict_max_tokens!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(f"max_tokens must be >= {MIN_MAX_TOKENS}, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing by it overflows float32: its limit."""
        return self.temperature < GREEDY_BELOW

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self._stop_ids


def _require(name: str, value: object, kind: type) -> None:
    """TypeError unless `value` is a `kind` (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        noun = "an integer" if kind is int else "a number"
        raise TypeError(f"{name} must be {noun}, got {value!r}")
