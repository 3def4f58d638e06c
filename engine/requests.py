"""Request bookkeeping between the caller and the scheduler: prompts in, `RequestOutput`s out.

Turns each prompt (text, token ids, or chat messages) into a `Sequence`, remembers which request
each sequence belongs to, watches stop strings, and assembles a request's samples (or a beam
group's hypotheses) into one `RequestOutput` when the last of them finishes.

A prompt dict holds one of `prompt` (text), `prompt_token_ids` or `messages` (a chat), and may
hold `request_id` and `sampling_params`. A chat's dict may also hold `chat`, the options of its
chat template under vLLM's names of them (`prompts.CHAT_OPTIONS`):
`{"messages": [...], "chat": {"add_generation_prompt": False, "continue_final_message": True,
"chat_template": "...", "chat_template_kwargs": {"enable_thinking": False}}}`. The defaults are
vLLM's: a generation prompt added, the final message not continued, the tokenizer's template.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .core.beam_search import BeamGroup, BeamSearchParams, Hypothesis
from .core.sampling_params import SamplingParams
from .core.scheduler import Scheduler, SchedulerOutput
from .core.sequence import Sequence, SequenceStatus
from .detokenizer import IncrementalDetokenizer, decode_text
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .prompts import BadRequest, bad_words_token_ids, render_chat
from .runner.model_runner import StepResult
from .runner.prompt_logprobs import PromptLogprobs

PromptInput = str | list[int] | dict


def _text_ids(seq: Sequence) -> list[int]:
    """The output tokens a sample's text is made of: all but the stop token (EOS, one of
    stop_token_ids) that ended it, unless `include_stop_str_in_output` keeps it (vLLM's rule)."""
    ids = seq.output_token_ids
    by_token = seq.status == SequenceStatus.FINISHED_STOPPED and isinstance(seq.stop_reason, int)
    return ids[:-1] if by_token and not seq.sampling_params.include_stop_str_in_output else ids


@dataclass
class _Request:
    index: int
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    arrival: float
    samples: dict[int, CompletionOutput] = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: tuple[str, str] | None = None  # (code, message) of the first sample that failed
    prompt_logprobs: tuple[list[float | None], list[list]] | None = None  # by prompt position


class RequestTracker:
    """Owns the request-level state of everything in flight."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._requests: dict[str, _Request] = {}
        self._detoks: dict[int, tuple[IncrementalDetokenizer, list[int]]] = {}
        # (request, sample) -> the sampled tokens' logprobs and each position's top tokens
        self._logprobs: dict[tuple[str, int], tuple[list[float], list[list]]] = {}
        self._rendered: dict[int, CompletionOutput] = {}  # seq_id -> output made by `render`
        self._beam_outputs: dict[str, list[CompletionOutput]] = {}  # request -> hypotheses

    def __len__(self) -> int:
        return len(self._requests)

    def clear(self) -> int:
        """Forget every request in flight (after the scheduler aborted them); returns how many."""
        n = len(self._requests)
        self._requests.clear()
        self._detoks.clear()
        self._logprobs.clear()
        self._rendered.clear()
        self._beam_outputs.clear()
        return n

    def add(
        self,
        index: int,
        item: PromptInput,
        params: SamplingParams | BeamSearchParams,
        scheduler: Scheduler,
    ) -> list[RequestOutput]:
        """Queue one request; a bad or impossible one comes back at once as an error output."""
        request_id = str(item.get("request_id", index)) if isinstance(item, dict) else str(index)
        try:
            if isinstance(item, dict) and item.get("sampling_params") is not None:
                params = item["sampling_params"]
            prompt, ids = self._tokenize(item)
        except BadRequest as exc:
            return [RequestOutput(request_id, index, None, [], error=str(exc), error_code=exc.code)]
        except (ValueError, TypeError) as exc:  # e.g. the tokenizer or chat template refusing it
            return [
                RequestOutput(
                    request_id, index, None, [], error=str(exc), error_code="invalid_prompt"
                )
            ]
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam is None and params.stop and self.tokenizer is None:
            msg = "stop strings need a tokenizer, and this model has none; use stop_token_ids"
            return [
                RequestOutput(request_id, index, prompt, ids, error=msg, error_code="no_tokenizer")
            ]
        if request_id in self._requests:
            msg = f"request id {request_id!r} is already in flight"
            return [
                RequestOutput(request_id, index, prompt, ids, error=msg, error_code="duplicate_id")
            ]
        seq_params = beam.sampling_params() if beam is not None else params
        extra_eos = self.eos_token_ids[1:]
        if extra_eos and not seq_params.ignore_eos:
            seq_params = replace(
                seq_params, stop_token_ids=(*seq_params.stop_token_ids, *extra_eos)
            )
        try:
            seq_params = self._token_fields(seq_params)
        except BadRequest as exc:
            return [
                RequestOutput(request_id, index, prompt, ids, error=str(exc), error_code=exc.code)
            ]
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        seq = Sequence(ids, seq_params, request_id=request_id, eos_token_id=eos)
        if beam is not None:
            BeamGroup(beam, seq, self.eos_token_ids)
        req = _Request(index, request_id, prompt, ids, params, time.time())
        req.metrics.arrival_time = req.arrival
        req.metrics.num_prompt_tokens = len(ids)
        self._requests[request_id] = req
        scheduler.add(seq)
        return self.collect([seq]) if seq.is_finished else []

    def _token_fields(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words tokenized; BadRequest for a token id of `logit_bias` or
        `allowed_token_ids` outside the vocabulary, or bad words without a tokenizer."""
        self._check_in_vocab([t for t, _ in params.logit_bias], "logit_bias token ids")
        self._check_in_vocab(params.allowed_token_ids, "allowed_token_ids token ids")
        if not params.bad_words or params.bad_words_token_ids:  # none, or tokenized already
            return params
        if self.tokenizer is None:
            raise BadRequest("no_tokenizer", "bad_words need a tokenizer, and this model has none")
        return params.with_bad_words_ids(bad_words_token_ids(self.tokenizer, params.bad_words))

    def _tokenize(self, item: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(item, dict):
            keys = [k for k in ("prompt", "prompt_token_ids", "messages") if k in item]
            if len(keys) != 1:
                raise BadRequest(
                    "invalid_prompt", "give exactly one of prompt, prompt_token_ids or messages"
                )
            if keys[0] == "messages":
                return None, self._render_chat(item["messages"], item.get("chat"))
            item = item[keys[0]]
        if isinstance(item, str):
            return item, self._encode(item, add_special_tokens=True)
        if isinstance(item, list | tuple) and all(isinstance(t, int) for t in item):
            self._check_in_vocab(item, "token ids")
            return None, list(item)
        raise BadRequest(
            "invalid_prompt",
            f"a prompt is text, a list of token ids or chat messages, not {type(item).__name__}",
        )

    def _check_in_vocab(self, ids, what: str) -> None:
        """BadRequest (`token_out_of_vocab`) naming the first of `ids` outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(
                "token_out_of_vocab",
                f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("no_tokenizer", "this model has no tokenizer: give prompt_token_ids")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _render_chat(self, messages, chat: dict | None) -> list[int]:
        """The tokens of `messages` rendered by the chat template with the `chat` options
        (`prompts.render_chat`), tokenized without adding special tokens again (the template
        writes them), as vLLM renders a chat request."""
        if self.tokenizer is None:
            raise BadRequest("no_tokenizer", "this model has no tokenizer: give prompt_token_ids")
        return self._encode(render_chat(self.tokenizer, messages, chat), add_special_tokens=False)

    def record_logprobs(self, out: SchedulerOutput, result: StepResult) -> None:
        """Keep the logprobs of this step's tokens and prompt positions (before `update` forks
        any children)."""
        if result.prompt_logprobs is not None:
            for seq, chunk in zip(out.seqs, result.prompt_logprobs, strict=True):
                if chunk is not None and seq.request_id in self._requests:
                    self._record_prompt(self._requests[seq.request_id], chunk)
        if result.logprobs is None:
            return
        tops = result.top_logprobs or [None] * len(out.seqs)
        for seq, row, top in zip(out.seqs, result.logprobs, tops, strict=True):
            if not row or not seq.sampling_params.wants_logprobs or seq.is_finished:
                continue
            for j, lp in enumerate(row):
                index = j if len(row) > 1 else seq.sample_index
                kept = self._logprobs.setdefault((seq.request_id, index), ([], []))
                kept[0].append(lp)
                kept[1].append(top[j] if top else [])

    @staticmethod
    def _record_prompt(req: _Request, chunk: PromptLogprobs) -> None:
        """Keep a chunk's prompt logprobs by position (a prompt computed again after a
        preemption gives the same values for the same positions)."""
        if req.prompt_logprobs is None:
            n = len(req.prompt_token_ids)
            req.prompt_logprobs = ([None] * n, [[] for _ in range(n)])
        values, tops = req.prompt_logprobs
        end = chunk.first + len(chunk.values)
        values[chunk.first : end] = chunk.values
        tops[chunk.first : end] = chunk.top

    def check_stop_strings(
        self, seqs: list[Sequence]
    ) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """Running sequences whose text now contains one of their stop strings, and those whose
        text could not be made, each with what its tokenizer raised (its request fails alone)."""
        stopped, failed = [], []
        for seq in seqs:
            if not seq.sampling_params.stop or seq.is_finished:
                continue
            try:
                if self._detokenize(seq).stopped_on:
                    stopped.append(seq)
            except Exception as exc:
                failed.append((seq, exc))
        return stopped, failed

    def _detokenize(self, seq: Sequence) -> IncrementalDetokenizer:
        entry = self._detoks.get(seq.seq_id)
        if entry is None:
            p = seq.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_token_ids,
                p.stop,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens,
            )
            entry = self._detoks[seq.seq_id] = (detok, [0])
        detok, fed = entry
        ids = _text_ids(seq)
        if fed[0] < len(ids):
            detok.append(ids[fed[0] :])
            fed[0] = len(ids)
        return detok

    def render(self, finished: list[Sequence]) -> list[tuple[Sequence, Exception]]:
        """Make the outputs (text included) of finished samples ahead of `collect`; return the
        samples whose output could not be made, each with the exception, so that the caller can
        fail their requests (siblings still running included) before collecting."""
        failed = []
        for seq in finished:
            if seq.status == SequenceStatus.FINISHED_ERROR or seq.seq_id in self._rendered:
                continue
            if seq.beam is not None and not seq.beam.done:
                continue  # a beam its group let go: nothing of its own to show
            try:
                if seq.beam is not None:
                    if seq.request_id not in self._beam_outputs:
                        self._beam_outputs[seq.request_id] = self._hypotheses(seq.beam)
                else:
                    self._rendered[seq.seq_id] = self._completion(seq)
            except Exception as exc:
                failed.append((seq, exc))
        return failed

    def collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        """Record finished samples; return the requests whose every sample is now done."""
        done = []
        for seq in finished:
            if seq.beam is not None:
                request = self._collect_beam(seq)
                if request is not None:
                    done.append(request)
                continue
            req = self._requests[seq.request_id]
            sample = self._rendered.pop(seq.seq_id, None)
            if sample is None:
                sample = self._completion(seq)
            req.samples[seq.sample_index] = sample
            if seq.status == SequenceStatus.FINISHED_ERROR and req.error is None:
                req.error = (seq.error_code or "internal_error", seq.error or "failed")
            m = req.metrics
            m.num_preemptions += seq.num_preemptions
            m.num_recomputed_tokens += seq.num_recomputed_tokens
            if seq.sample_index == 0:
                m.num_cached_tokens = seq.num_cached_tokens
            never_forked = seq.sample_index == 0 and seq.num_output_tokens == 0
            if len(req.samples) == req.params.n or never_forked:
                done.append(self._finish_request(req))
        return done

    def _collect_beam(self, seq: Sequence) -> RequestOutput | None:
        """Count a released beam of a group; the request's output once its group is done."""
        req = self._requests.get(seq.request_id)
        if req is None:  # its request already ended (the group failed as a whole)
            return None
        m = req.metrics
        m.num_cached_tokens += seq.num_cached_tokens
        m.num_recomputed_tokens += seq.num_recomputed_tokens
        group = seq.beam
        if seq.status == SequenceStatus.FINISHED_ERROR:
            req.error = (seq.error_code or "internal_error", seq.error or "failed")
        elif not group.done:
            return None
        else:
            outputs = self._beam_outputs.pop(req.request_id, None)
            if outputs is None:
                outputs = self._hypotheses(group)
            if not outputs:
                req.error = ("kv_cache_full", "the KV cache cannot hold this beam search")
            req.samples = dict(enumerate(outputs))
        m.num_preemptions = group.num_preemptions
        stats = group.stats
        m.peak_blocks, m.peak_blocks_unshared = stats.peak_blocks, stats.peak_blocks_unshared
        m.num_shared_blocks, m.num_cow_copies = stats.num_shared_blocks, stats.num_cow_copies
        return self._finish_request(req)

    def _hypotheses(self, group: BeamGroup) -> list[CompletionOutput]:
        """A finished group's hypotheses as outputs, best first."""
        return [
            CompletionOutput(
                index=i,
                text=self._hypothesis_text(h, group.params),
                token_ids=h.token_ids,
                finish_reason=h.finish_reason,
                stop_reason=h.stop_reason,
                logprobs=h.logprobs if group.params.logprobs else None,
                cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(group.finished)
        ]

    def _hypothesis_text(self, h: Hypothesis, params: BeamSearchParams) -> str:
        """A hypothesis's text, without the stop token that ended it (as vLLM's beam search)."""
        if self.tokenizer is None:
            return ""
        ids = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
        return decode_text(
            self.tokenizer, ids, params.skip_special_tokens, params.spaces_between_special_tokens
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text, reason, stop_reason = "", seq.finish_reason, seq.stop_reason
        if seq.status == SequenceStatus.FINISHED_ERROR:
            pass  # its request reports the error, not text (whose decoding may be what failed)
        elif self.tokenizer is not None and seq.sampling_params.stop:
            detok = self._detokenize(seq)
            text = detok.text if detok.stopped_on else detok.text + detok.finish()
            if detok.stopped_on:
                reason, stop_reason = "stop", detok.stopped_on
        elif self.tokenizer is not None:
            p = seq.sampling_params
            text = decode_text(
                self.tokenizer,
                _text_ids(seq),
                p.skip_special_tokens,
                p.spaces_between_special_tokens,
            )
        self._detoks.pop(seq.seq_id, None)
        logprobs, top = self._logprobs.pop((seq.request_id, seq.sample_index), (None, None))
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=seq.output_token_ids,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=logprobs if seq.sampling_params.wants_logprobs else None,
            top_logprobs=top if seq.sampling_params.top_logprobs else None,
        )

    def _finish_request(self, req: _Request) -> RequestOutput:
        del self._requests[req.request_id]
        req.metrics.finished_time = time.time()
        code, error = req.error or (None, None)
        outputs = [] if error else [req.samples[i] for i in sorted(req.samples)]
        prompt_logprobs = prompt_top = None
        if req.prompt_logprobs is not None and not error:
            prompt_logprobs, prompt_top = req.prompt_logprobs
        return RequestOutput(
            req.request_id,
            req.index,
            req.prompt,
            req.prompt_token_ids,
            outputs,
            error,
            metrics=req.metrics,
            error_code=code,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top,
        )
