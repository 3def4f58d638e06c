"""Per-request sampling and stopping parameters, each field with its `SamplingField`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .sampling_fields import SamplingField, params_check, sampling_field, specs

GREEDY_BELOW = 1e-5  # as vLLM: a temperature under this samples greedily
MAX_LOGPROBS = 20  # most likely tokens a position may report (OpenAI's top_logprobs bound)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
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
    include_stop_str_in_output: bool = sampling_field(
        False,
        "end the text with the stop string that ended the sample (what follows it is still "
        "cut), or with the text of the stop token (EOS, stop_token_ids) that did, which is "
        "otherwise left out (vLLM's rule; a special token's text only with "
        "skip_special_tokens false)",
        "bool",
        beam="ignored",  # no stop strings; a hypothesis's text never has its stop token
    )
    skip_special_tokens: bool = sampling_field(
        True,
        "leave the special tokens' text (EOS, chat markers) out of the output text, where stop "
        "strings are matched",
        "bool",
        beam="group",
    )
    spaces_between_special_tokens: bool = sampling_field(
        True,
        "with skip_special_tokens false: false puts an added token right after another as its "
        "bare text, without a space the tokenizer's decoder may put between them, as vLLM does "
        "with a fast tokenizer (byte-level and SentencePiece decoders put none: no change)",
        "bool",
        beam="group",
    )
    logprobs: bool = sampling_field(
        False,
        "the sampled tokens' log-probabilities (each hypothesis's tokens' with beam search)",
        "bool",
        beam="group",
        one_step=True,  # each step's logits, gathered on the host
    )
    top_logprobs: int = sampling_field(
        0,
        "the most likely tokens at each output position, this many, with their "
        "log-probabilities (implies logprobs)",
        "int",
        low=0,
        high=MAX_LOGPROBS,
        beam="refused",
        one_step=True,
    )
    prompt_logprobs: int | None = sampling_field(
        None,
        "the log-probability of each prompt token given the ones before it, with this many "
        "most likely tokens at each position (0: the prompt's own tokens only); computed again "
        "for a prefix the cache holds",
        "int",
        low=0,
        high=MAX_LOGPROBS,
        beam="refused",
    )
    logprobs_mode: str = sampling_field(
        "raw_logprobs",
        "what logprobs report (vLLM's names): the model's distribution (raw_) or the one "
        "sampled from after penalties, biases, masks, temperature, top-k/top-p/min-p "
        "(processed_), as log-probabilities or logits",
        "choice",
        choices=LOGPROBS_MODES,
        beam="refused",
        job=True,
        flag="Default logprobs_mode: raw_logprobs, processed_logprobs, raw_logits or "
        "processed_logits.",
    )
    presence_penalty: float = sampling_field(
        0.0,
        "subtracted once from the logit of each token the output holds (OpenAI's rule)",
        "float",
        low=-2,
        high=2,
        beam="refused",
        shapes=True,
        job=True,
    )
    frequency_penalty: float = sampling_field(
        0.0,
        "subtracted from each token's logit once per time the output holds it (OpenAI's rule)",
        "float",
        low=-2,
        high=2,
        beam="refused",
        shapes=True,
        job=True,
    )
    repetition_penalty: float = sampling_field(
        1.0,
        "divides the positive logits and multiplies the negative ones of the tokens the prompt "
        "or the output holds (vLLM's and transformers' rule)",
        "float",
        low=0,
        low_open=True,
        note="1 is off",
        beam="refused",
        shapes=True,
        job=True,
    )
    logit_bias: tuple[tuple[int, float], ...] = sampling_field(
        (),
        "token id -> a number added to its logit (a line's values are clamped to [-100, 100], "
        "as OpenAI clamps them)",
        "bias",
        beam="refused",
        shapes=True,
    )
    allowed_token_ids: tuple[int, ...] = sampling_field(
        (),
        "the only token ids that may be sampled (none: any)",
        "ints",
        beam="refused",
        shapes=True,
    )
    bad_words: tuple[str, ...] = sampling_field(
        (),
        "words never generated: a word's last token is masked where the output ends in its "
        "other tokens (vLLM's rule: each word with and without a leading space)",
        "strs",
        beam="refused",
        shapes=True,
        one_step=True,  # matched against the output's last tokens, on the host
    )
    min_tokens: int = sampling_field(
        0,
        "output tokens before EOS, a stop token or a stop string may end a sample (EOS and the "
        "stop tokens are masked until then)",
        "int",
        low=0,
        beam="refused",
        shapes=True,
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
    _shapes_logits: bool = field(default=False, init=False, repr=False, compare=False)
    _bad_words_ids: tuple[tuple[int, ...], ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check(self)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        object.__setattr__(self, "_stop_ids", frozenset(self.stop_token_ids))
        steps = all(spec.at_default(getattr(self, name)) for name, spec in _ONE_STEP.items())
        object.__setattr__(self, "_multi_step", steps)
        shaped = any(not spec.at_default(getattr(self, n)) for n, spec in _PROCESSORS.items())
        object.__setattr__(self, "_shapes_logits", shaped)

    @property
    def shapes_logits(self) -> bool:
        """Whether a logits processor acts on this sequence's rows (a penalty, a bias, a mask
        or min_tokens: `runner.logits_processors`)."""
        return self._shapes_logits

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token ids, once a tokenizer has made them (`with_bad_words_ids`)."""
        return self._bad_words_ids

    def with_bad_words_ids(self, ids: tuple[tuple[int, ...], ...]) -> SamplingParams:
        """These params with `bad_words` tokenized as `ids` (by the engine's tokenizer)."""
        params = replace(self)
        object.__setattr__(params, "_bad_words_ids", tuple(map(tuple, ids)))
        return params

    @property
    def wants_logprobs(self) -> bool:
        """Whether each sampled token's log-probability is kept (`logprobs`, `top_logprobs`)."""
        return self.logprobs or self.top_logprobs > 0

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
_PROCESSORS = {name: spec for name, spec in SAMPLING_FIELDS.items() if spec.shapes}
