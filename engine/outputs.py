"""What `LLM.generate` / `LLM.stream` hand back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None  # log-probability of each sampled token
    cumulative_logprob: float | None = None  # their sum, for a beam-search hypothesis
    # with top_logprobs: each position's most likely (token id, logprob) pairs, best first
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestMetrics:
    """Per-request engine counters."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    arrival_time: float = 0.0
    finished_time: float = 0.0
    # Beam search only (see `engine.beam_search.BeamStats`): the most KV blocks the group's
    # beams held at once, what they would have held with private copies, the blocks two or
    # more beams shared at that peak, and the copy-on-write copies.
    peak_blocks: int = 0
    peak_blocks_unshared: int = 0
    num_shared_blocks: int = 0
    num_cow_copies: int = 0


@dataclass
class RequestOutput:
    """The result of one request: its samples, or the error that refused it."""

    request_id: str
    index: int  # position of the request in the input
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None  # why the request was refused; `outputs` is then empty
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error_code: str | None = None  # machine-readable: prompt_too_long, token_out_of_vocab, ...
    # with prompt_logprobs: each prompt token's log-probability given those before it (None for
    # the first) and its position's most likely (token id, logprob) pairs
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None
