"""The exact bytes of one token, for log-probabilities that spell the text they describe.

Decoding a token alone loses bytes: an emoji split over two byte-level BPE tokens decodes as two
U+FFFD, whose UTF-8 bytes are not the emoji's. The bytes come from the token's vocabulary piece
instead: byte-level BPE (GPT-2, Llama 3, SmolLM2) maps each byte to one printable character;
SentencePiece writes a byte-fallback token as `<0xHH>` and a space as U+2581.
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted (the table every byte-level BPE uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)  # alone or in a Sequence


class TokenBytes:
    """`token_bytes(id)`: a token's bytes under `tokenizer` (memoized per id)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self.special:
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            if self.byte_level:
                table = _byte_level_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            elif "\u2581" in piece:
                return piece.replace("\u2581", " ").encode("utf-8")
        return tok.decode([token_id]).encode("utf-8")
