"""What a request's prompt is made of before it is tokenized: a chat rendered by its template,
bad words as token ids; `BadRequest`, the error a request that cannot be run gets."""

from __future__ import annotations

import inspect
from typing import Any


class BadRequest(ValueError):
    """A request that cannot be run as given; it becomes that request's error, not the call's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# A chat prompt's template options (its dict's "chat"), each with its default: vLLM's fields.
CHAT_OPTIONS: dict[str, Any] = {
    "add_generation_prompt": True,  # end with the header of a new assistant message
    "continue_final_message": False,  # leave the last message open for the model to continue
    "chat_template": None,  # a Jinja template in place of the tokenizer's
    "chat_template_kwargs": None,  # more variables for the template (Qwen3's enable_thinking)
}
_OPTION_TYPES = {
    "add_generation_prompt": (bool, "true or false"),
    "continue_final_message": (bool, "true or false"),
    "chat_template": (str, "a string"),
    "chat_template_kwargs": (dict, "an object"),
}


def _template_args(tokenizer, chat: dict | None) -> dict[str, Any]:
    """`apply_chat_template`'s keyword arguments for a prompt's `chat` options (None ones at
    their defaults, an empty chat_template too). BadRequest (`invalid_field`) for an unknown
    option or a wrong type, both add_generation_prompt and continue_final_message true (which
    vLLM refuses), or a chat_template_kwargs key that is an argument of apply_chat_template
    itself (`tokenize`, `add_generation_prompt`, ...: an option of its own, or no template
    variable)."""
    chat = chat or {}
    if not isinstance(chat, dict):
        raise BadRequest("invalid_field", f"chat options must be a dict, got {type(chat).__name__}")
    unknown = sorted(set(chat) - set(CHAT_OPTIONS))
    if unknown:
        raise BadRequest(
            "invalid_field", f"unknown chat options {unknown}; known: {', '.join(CHAT_OPTIONS)}"
        )
    opts = {k: default if chat.get(k) is None else chat[k] for k, default in CHAT_OPTIONS.items()}
    for key, (kind, allowed) in _OPTION_TYPES.items():
        if opts[key] is not None and not isinstance(opts[key], kind):
            raise BadRequest("invalid_field", f"{key} must be {allowed}, got {opts[key]!r}")
    if opts["add_generation_prompt"] and opts["continue_final_message"]:
        raise BadRequest(
            "invalid_field",
            "continue_final_message and add_generation_prompt cannot both be true "
            "(add_generation_prompt is true unless given): give add_generation_prompt false",
        )
    extra = opts.pop("chat_template_kwargs") or {}
    own = {"messages", "conversation"} | {
        p.name
        for p in inspect.signature(tokenizer.apply_chat_template).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    clash = sorted(k for k in extra if k in own)
    if clash:
        raise BadRequest(
            "invalid_field",
            f"chat_template_kwargs cannot set {', '.join(clash)}: an argument of "
            "apply_chat_template, not a template variable (add_generation_prompt, "
            "continue_final_message and chat_template are options of their own)",
        )
    if not opts["chat_template"]:  # "" too, as in vLLM: the tokenizer's own
        del opts["chat_template"]
    return {**extra, **opts}


def render_chat(tokenizer, messages, chat: dict | None) -> str:
    """The text the chat template makes of `messages` with the `chat` options (`CHAT_OPTIONS`);
    BadRequest for options or messages it cannot take, and for a template that raises."""
    args = _template_args(tokenizer, chat)
    if not (args.get("chat_template") or getattr(tokenizer, "chat_template", None)):
        raise BadRequest(
            "no_chat_template",
            "this model has no chat template: give a prompt, not messages, or a chat_template",
        )
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise BadRequest("invalid_messages", "messages must be a list of {role, content} objects")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **args)
    except Exception as exc:  # the template is the request's code: whatever it raises
        first = (str(exc).splitlines() or [""])[0][:300]
        raise BadRequest(
            "chat_template_failed", f"the chat template failed: {type(exc).__name__}: {first}"
        ) from None


def bad_words_token_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's tokens as vLLM makes them: the word without its leading spaces, and with
    one leading space where that gives another first token and as many tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if bare:
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
    return tuple(out)
