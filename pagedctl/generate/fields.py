"""What one `pagedctl generate` request line may carry: the body's fields and what pagedctl does
with each (docs/jobs.md lists them; a test keeps the two equal), the fields of other APIs it
accepts only at their neutral values, and other APIs' names for OpenAI's fields.

The sampling fields are the engine's: every `SamplingParams` field a line may give and the beam
search's own (`SAMPLING_FIELDS`, `BEAM_ONLY_FIELDS`), by their names and aliases, described by
their `SamplingField`. The rest are the request's own (the prompt, the model, ...).
"""

from __future__ import annotations

from typing import Any

from pagedctl.engine import BEAM_ONLY_FIELDS, SAMPLING_FIELDS, SamplingField

# The sampling fields a line may give, by their own names (aliases in `ALIASES`).
LINE_FIELDS: dict[str, SamplingField] = {
    name: spec for name, spec in {**SAMPLING_FIELDS, **BEAM_ONLY_FIELDS}.items() if spec.line
}
ALIASES: dict[str, str] = {a: name for name, spec in LINE_FIELDS.items() for a in spec.aliases}
_BEAM_NOTES = {"ignored": " (no effect on beam search)", "refused": " (not with beam search)"}


def describe(name: str) -> str:
    """What sampling field `name` does, with what beam search makes of it."""
    spec = LINE_FIELDS[name]
    return spec.help + _BEAM_NOTES.get(spec.beam, "")


# Every field a request body may carry and what pagedctl does with it. A field that is not here, in
# `UNSUPPORTED` or in `OTHER_NAMES` is refused on its line as unknown, as OpenAI's API refuses an
# unrecognized argument: a typo like "temprature" must never run at the default.
FIELDS: dict[str, str] = {
    "messages": "chat: the conversation",
    "prompt": "completions: the prompt text or token ids",
    "prompt_token_ids": "simple form: the prompt as token ids",
    "model": "the served model's name (`--served-model-name`); another name is refused",
    **{name: describe(name) for name in LINE_FIELDS},
    **{alias: f"alias of {name}" for alias, name in ALIASES.items()},
    "best_of": "only equal to n",
    "use_beam_search": "true: run the request by beam search, n beams, best first",
    "user": "ignored: no effect on the output",
    "metadata": "ignored: no effect on the output",
    "store": "ignored: no effect on the output",
    "service_tier": "ignored: no effect on the output",
    "priority": "ignored: a batch job runs lines first come, first served",
    "request_id": "ignored: the job's id is custom_id",
    "echo": "completions: the prompt's text (with logprobs, its tokens') before the completion; "
    "with max_tokens 0, the prompt alone",
    "add_generation_prompt": "chat: end the prompt with a new assistant message's header "
    "(default true)",
    "continue_final_message": "chat: leave the last message open for the model to continue "
    "(default false; needs add_generation_prompt false)",
    "chat_template": "chat: a Jinja chat template for this line, in place of --chat-template's "
    "or the model's",
    "chat_template_kwargs": "chat: more variables for the chat template, as an object "
    '({"enable_thinking": false})',
}
# Fields of OpenAI's or vLLM's API that pagedctl does not implement, with the values that leave
# the output unchanged (null always does): accepted at those, `unsupported_field` otherwise.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
    "stream": (False,), "stream_options": (), "suffix": ("",), "add_special_tokens": (),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "logits_processors": ([],),
    "mm_processor_kwargs": (), "truncate_prompt_tokens": (),
}  # fmt: skip
# Names from other APIs (Hugging Face generate, Anthropic, TGI) that mean an OpenAI field.
OTHER_NAMES: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "max_length": "max_tokens",
    "stop_sequences": "stop",
    "do_sample": "temperature (0 is greedy)",
    "num_return_sequences": "n",
    "num_beams": "n with use_beam_search: true",
}
# The fields that take an integer: the sampling fields of that kind, `best_of`, and `logprobs`
# of the completions form (chat's is true or false). A float with no fractional part (4.0) is that
# integer, as OpenAI's API and vLLM's take it (some JSON writers print every number as a float:
# pandas, for a column with gaps); 4.5 is refused for its fractional part. Token ids (prompt,
# prompt_token_ids, stop_token_ids) stay integers: a list of floats is no list of token ids.
INTEGER_FIELDS = (
    *(n for name, spec in LINE_FIELDS.items() if spec.kind == "int" for n in (name, *spec.aliases)),
    "best_of",
    "logprobs",
)
ENVELOPE = ("custom_id", "method", "url", "body")  # the OpenAI form's top level
SIMPLE_IDS = ("custom_id", "id")
