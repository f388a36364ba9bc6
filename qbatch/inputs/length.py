"""Prompts whose length alone shows they cannot fit max_model_len, refused before the tokenizer sees them.

Tokenizing costs about 225 bytes of memory a byte of text (a 200 MB line was killed at 23 GB), for a
row that is then refused as too long. A token stands for at most L bytes of text, L the longest
token of the vocabulary in the bytes it stands for (added tokens included; a byte-level spelling is
a byte a character, a SentencePiece one at least as long as its text), and a character is at least
a byte, also once a normalizer joined characters (NFC, NFKC): a text of C characters has at least
C // L tokens. That holds
only where tokenizing drops no text: a tokenizer that drops blank or control characters (BERT's
WordPiece, SentencePiece's extra-whitespace removal) fails the probe below and gets no early check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from qbatch.errors import RowError

# blank runs, control and invisible characters: what a tokenizer that drops text drops first
PROBE = "a  \t\t b\n\n c\x00\x07 d\u200b\u00ad\ufeff e  \r\n f"


def encode_within(texts: list[str], encode: Callable[[list[str]], list[Any]], tokenizer: Any,
                  max_tokens: int | None, *, embeds: bool) -> list[Any]:
    """encode(texts), with a RowError("prompt_too_long") in place of each text too long to fit `max_tokens`
    by its length alone (then not tokenized; None: no limit). An embedding input may hold max_tokens, a
    prompt fewer (its output needs room)."""
    limit = max_token_chars(tokenizer) if max_tokens is not None else None
    refused: dict[int, RowError] = {}
    if limit is not None and max_tokens is not None:
        for index, text in enumerate(texts):
            floor = len(text) // limit
            if floor > max_tokens or (floor == max_tokens and not embeds):
                refused[index] = _too_long(floor, len(text), max_tokens, embeds=embeds)
    if not refused:
        return encode(texts)
    kept = [text for index, text in enumerate(texts) if index not in refused]
    encoded = iter(encode(kept) if kept else [])
    return [refused[index] if index in refused else next(encoded) for index in range(len(texts))]


def _too_long(floor: int, chars: int, max_tokens: int, *, embeds: bool) -> RowError:
    """The words of the tokenized check (prepare.py), with the bound in place of the count."""
    count = f"at least {floor} tokens ({chars} characters, not tokenized)"
    if embeds:
        return RowError("prompt_too_long", f"input has {count} but max_model_len is {max_tokens}; pass --truncate "
                                           f"to embed its first {max_tokens} tokens, or raise --max-model-len")
    return RowError("prompt_too_long", f"prompt has {count} but max_model_len is {max_tokens}, leaving no room for "
                                       "output; raise --max-model-len or shorten the prompt")


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer: Any) -> int | None:
    """At most how many characters of text one token stands for; None: the tokenizer may drop text
    (the bound would not hold), or it has no vocabulary to tell."""
    try:
        vocab = tokenizer.get_vocab()
        ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        kept = tokenizer.decode(ids, clean_up_tokenization_spaces=False) == PROBE
    except Exception:  # a tokenizer of another kind: no early check, the tokenized one still holds
        return None
    if not kept or not vocab:
        return None
    if _byte_level(tokenizer):  # each character of a token's spelling stands for one byte (Ġ: a space)
        return max(len(token) for token in vocab)
    return max(len(token.encode("utf-8", "surrogatepass")) for token in vocab)


def _byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
