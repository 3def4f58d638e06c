"""Per-request sampling and stopping parameters, each field with its `SamplingField`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_fields import SamplingField, params_check, sampling_field, specs

GREEDY_BELOW = 1e-5  # as vLLM: a temperature under this samples greedily
MIN_MAX_TOKENS = 1  # the fewest output tokens a request may ask for (a job's lines, a sweep's)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request and when to stop it; checked when built.

    `temperature == 0` means greedy. `n > 1` draws n samples from one prompt, whose KV is computed
    and stored once and shared by reference count (copy-on-write). `max_tokens` counts output
    tokens of each sample. `stop` strings are matched on detokenized text by the caller (the
    scheduler only sees token ids); `stop_token_ids` and EOS are matched by the scheduler.

    `strict_max_tokens`: refuse, rather than cut short, a request whose prompt plus `max_tokens`
    exceeds `max_model_len`, as OpenAI's API does (error code `context_length_exceeded`). Off, such
    a request runs and ends with finish reason "length", stop reason "max_model_len", when it
    reaches the limit.

    Each field's metadata is its `SamplingField` (`SAMPLING_FIELDS`): its check, its description
    and names on a request line, how a beam search takes it, whether it keeps a sequence out of
    a multi-step window and whether a job's defaults may set it.
    """

    n: int = sampling_field(
        1,
        "samples of one prompt, whose KV is computed once and shared; with use_beam_search, the "
        "beam width (required; every beam is returned)",
        "int",
        low=1,
        beam="group",
        beam_name="beam_width",
    )
    temperature: float = sampling_field(
        1.0,
        "sampling temperature; 0 (anything below 1e-5) is greedy",
        "float",
        low=0,
        beam="ignored",
        job=True,
        flag="Default temperature (0 is greedy).",
    )
    top_p: float = sampling_field(
        1.0, "nucleus sampling", "float", low=0, low_open=True, high=1, beam="ignored", job=True,
        flag="Default top_p.",
    )  # fmt: skip
    top_k: int = sampling_field(
        0, "top-k sampling", "int", low=0, note="0 disables it", beam="ignored",
        job=True, flag="Default top_k (0 is off).",
    )  # fmt: skip
    min_p: float = sampling_field(
        0.0, "min-p sampling", "float", low=0, high=1, beam="ignored", job=True,
        flag="Default min_p.",
    )  # fmt: skip
    seed: int | None = sampling_field(
        None,
        "the request's own random stream: its samples are then the same whatever else runs "
        "beside it",
        "int",
        beam="ignored",
        job=True,
    )
    max_tokens: int = sampling_field(
        256,
        "output tokens per sample",
        "int",
        low=MIN_MAX_TOKENS,
        aliases=("max_completion_tokens",),
        job=True,
        flag="Default max_tokens of a line that gives none.",
    )
    stop: tuple[str, ...] = sampling_field(
        (),
        "stop strings, matched on the detokenized text",
        "strs",
        beam="refused",
        job=True,
        flag="Default stop string (repeatable).",
    )
    stop_token_ids: tuple[int, ...] = sampling_field(
        (), "token ids that end a sample as EOS does", "ints"
    )
    ignore_eos: bool = sampling_field(
        False, "keep going past EOS", "bool", job=True, flag="Default: keep going past EOS."
    )
    logprobs: bool = sampling_field(
        False,
        "the sampled tokens' log-probabilities (each hypothesis's tokens' with beam search)",
        "bool",
        beam="group",
        one_step=True,  # each step's logits, gathered on the host
    )
    cache_salt: str | None = sampling_field(
        None,
        "a tenant's prefix-cache salt: only requests with the same salt share a prefix",
        "str",
    )
    strict_max_tokens: bool = sampling_field(
        False,
        "refuse, rather than cut short, a prompt plus max_tokens over max_model_len",
        "bool",
        line=False,  # a line's own max_tokens is strict, the job's default is not
    )
    _stop_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)
    _multi_step: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "_stop_ids", frozenset(self.stop_token_ids))
        steps = all(spec.at_default(getattr(self, name)) for name, spec in _ONE_STEP.items())
        object.__setattr__(self, "_multi_step", steps)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing by it overflows float32: its limit."""
        return self.temperature < GREEDY_BELOW

    @property
    def multi_step(self) -> bool:
        """Whether a multi-step decode window may sample this sequence's tokens: no field is set
        that needs the host after every token (`SamplingField.one_step`)."""
        return self._multi_step

    def is_stop_token(self, token_id: int) -> bool:
        return token_id in self._stop_ids


SAMPLING_FIELDS: dict[str, SamplingField] = specs(SamplingParams)
_check = params_check(SAMPLING_FIELDS)
_ONE_STEP = {name: spec for name, spec in SAMPLING_FIELDS.items() if spec.one_step}
