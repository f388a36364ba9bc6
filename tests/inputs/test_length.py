"""The early length check: a text refused from its length alone, never tokenized; only where the bound holds."""

from __future__ import annotations

from qbatch.errors import RowError
from qbatch.inputs.length import encode_within


class Chars:
    """A tokenizer of one character a token (vocabulary: 'a', 'bb'); `drops` blank, as WordPiece does."""

    def __init__(self, drops: bool = False):
        self.drops = drops

    def get_vocab(self):
        return {"a": 0, "bb": 1}

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text if not (self.drops and c.isspace())]}

    def decode(self, ids, clean_up_tokenization_spaces=False):
        return "".join(map(chr, ids))


def encode(texts):
    assert all(len(text) < 100 for text in texts), "a long text reached the tokenizer"
    return [list(text) for text in texts]


def test_texts_too_long_by_their_length_are_refused_untokenized():
    texts = ["x" * 1000, "short", "y" * 20]  # at least 500 tokens, 5, 10
    got = encode_within(texts, encode, Chars(), 10, embeds=False)
    assert isinstance(got[0], RowError) and got[0].kind == "prompt_too_long"
    assert got[0].message.startswith("prompt has at least 500 tokens (1000 characters, not tokenized)")
    assert got[1] == list("short")
    assert isinstance(got[2], RowError)  # 10 tokens leave no room for output
    assert encode_within(texts[2:], encode, Chars(), 10, embeds=True) == [list("y" * 20)]  # an input may fill it
    assert encode_within(texts[1:], encode, Chars(), None, embeds=True) == [list("short"), list("y" * 20)]


def test_a_tokenizer_that_drops_text_gets_no_early_check():
    got = encode_within(["x" * 50], lambda texts: ["counted"], Chars(drops=True), 10, embeds=False)
    assert got == ["counted"]
