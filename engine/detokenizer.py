"""Incremental detokenization with stop strings.

Each step decodes a short window of tokens twice, from a prefix offset to the read offset and from
the prefix offset to the end, and emits the difference. Starting the window a little before the
new tokens gives decoders the context they need (a SentencePiece decoder strips the leading space
of the first token it sees; both decodes strip the same one). Text that ends in U+FFFD is a
character whose bytes are not all there yet (byte-level BPE, byte fallback): it is held until a
later token completes it, or until `finish`.

Stop strings follow the OpenAI semantics: the output is cut before the earliest match, the match
itself is not shown (with `include_stop_str_in_output`, vLLM's, the cut is after it). Text that
could be the start of a stop string is held back (unless the match is to be kept), so a streamed
delta is never taken back.
"""

from __future__ import annotations

import re
from typing import Any

_INCOMPLETE = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def decode_text(
    tokenizer: Any,
    ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """The text of `ids` as vLLM makes it with a fast tokenizer: `tokenizer.decode`, spaces not
    cleaned up. Special tokens kept and `spaces_between_special_tokens` false, an added token
    right after an added token is its bare content, without a space the decoder may put between
    them (a WordPiece decoder does; byte-level and SentencePiece ones put none). A fast
    tokenizer's own `decode` takes that option and ignores it (transformers 5)."""
    if skip_special_tokens or spaces_between_special_tokens:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
    added = tokenizer.added_tokens_decoder
    cuts = [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
    return "".join(
        tokenizer.decode(ids[a:b], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)
    )


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens and stops at the first stop string.

    Without a stop match, the concatenated deltas (and `text`, after `finish`) equal
    `decode_text(tokenizer, output_ids, skip_special_tokens, spaces_between_special_tokens)`.
    The text is that of the output alone, as `decode` gives it: `prompt_token_ids` do not change
    it. `include_stop_str_in_output`: the text ends with the stop string it stopped on.
    `min_tokens`: no stop string is looked for until the output holds more tokens than this,
    and then in the text that came since only (vLLM's rule).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # released text: the concatenation of every delta returned so far
        self.stopped_on: str | None = None
        self._ids: list[int] = []
        self._prefix_offset = 0  # decoding windows start here
        self._read_offset = 0  # tokens before this are decoded into `_decoded`
        self._decoded = ""  # decoded text; `text` plus what is held back for stop strings
        self._longest_stop = max(map(len, self.stop), default=0)
        self._byte_fallback = _has_byte_tokens(tokenizer)

    def append(self, token_ids: list[int]) -> str:
        """Add output tokens; return the text they make visible (may be empty)."""
        if self.stopped_on is not None or not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._release(self._decode_new(flush=False), final=False)

    def finish(self) -> str:
        """Release whatever is held back (an incomplete character, a partial stop string)."""
        if self.stopped_on is not None:
            return ""
        return self._release(self._decode_new(flush=True), final=True)

    def _decode_ids(self, ids: list[int]) -> str:
        return decode_text(
            self.tokenizer, ids, self.skip_special_tokens, self.spaces_between_special_tokens
        )

    def _decode_new(self, flush: bool) -> str:
        """Text of the tokens past the read offset, once it is complete (or when flushing)."""
        prefix = self._decode_ids(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode_ids(self._ids[self._prefix_offset :])
        # An empty addition (a skipped special token) keeps the window, so that the next token is
        # still decoded after real context.
        if not flush and (
            len(window) <= len(prefix)
            or window.endswith(_INCOMPLETE)
            or (self._byte_fallback and self._in_byte_run())
        ):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(prefix) :]

    def _in_byte_run(self) -> bool:
        """Whether the output ends in a run of SentencePiece byte-fallback tokens (`<0xE6>`).

        Such a decoder turns a whole run into U+FFFDs if the run is not valid UTF-8, so no text of
        a run is final before the run ends. Tokens that decode to nothing (skipped special
        tokens) do not end a run.
        """
        for token_id in reversed(self._ids[self._prefix_offset :]):
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(token, str) and _BYTE_TOKEN.fullmatch(token):
                return True
            if self._decode_ids([token_id]):
                return False
        return False

    def _release(self, new_text: str, final: bool) -> str:
        """Append decoded text, look for a stop string, and return the text now safe to show."""
        old_len = len(self._decoded)
        self._decoded += new_text
        end = len(self._decoded)
        match = None
        if len(self._ids) > self.min_tokens:
            match = self._find_stop(max(0, old_len - self._longest_stop + 1))
        if match is not None:
            end, self.stopped_on = match
            if self.include_stop_str_in_output:
                end += len(self.stopped_on)
        elif not final and not self.include_stop_str_in_output:  # nothing shown is cut then
            end -= self._partial_stop_len()
        delta = self._decoded[len(self.text) : end]
        self.text += delta
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string occurring at or after `start`, as (position, stop)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = self._decoded.find(stop, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        tail = self._decoded[-(self._longest_stop - 1) :] if self._longest_stop > 1 else ""
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:n]):
                    held = n
                    break
        return held


def _has_byte_tokens(tokenizer: Any) -> bool:
    """Whether the vocabulary has SentencePiece byte-fallback tokens `<0x00>`..`<0xFF>`."""
    names = ["<0x00>", "<0xFF>"]
    ids = tokenizer.convert_tokens_to_ids(names)
    return all(isinstance(i, int) for i in ids) and tokenizer.convert_ids_to_tokens(ids) == names
