"""Texts of finished rows, decoded once per chunk instead of token by token.

vLLM detokenizes every running request at every engine step in the process that
drives the engine: at thousands of running requests that is most of a step's CPU
time (docs/benchmarks.md), which that process must keep up with beside everything
else it does. qbatch only needs each row's final text, so
it asks vLLM for token ids alone and decodes a finished chunk in one batched call
of the Rust tokenizer. The text is the one vLLM's incremental detokenizer gives:
decoded after a few prompt tokens (so a first token's leading space comes out as
it would after the prompt), special tokens skipped, the stop token left out; a row
whose batched decode cannot be trusted (a character split across the prompt's
edge, or cut at the end) is replayed through the tokenizer's own DecodeStream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT_TOKENS = 8  # prompt tokens decoded before a row's output, then cut off again
REPLACEMENT = "\ufffd"


class FinalDecoder:
    """Decodes finished rows' token ids to text, as vLLM's FastIncrementalDetokenizer would."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`

    @classmethod
    def for_llm(cls, llm: Any) -> FinalDecoder | None:
        """A decoder for a vLLM `LLM`'s tokenizer, or None (vLLM then detokenizes as usual)."""
        try:
            tokenizer = llm.get_tokenizer()
        except Exception:  # e.g. an engine started without a tokenizer
            return None
        return cls.for_tokenizer(tokenizer)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> FinalDecoder | None:
        """A decoder for vLLM's tokenizer when it wraps a Rust one (else None: let vLLM detokenize)."""
        raw = getattr(tokenizer, "_tokenizer", None)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        return cls(raw) if isinstance(raw, Tokenizer) else None

    def decode(self, prompts: list[list[int]], outputs: Sequence[Sequence[int]]) -> list[str]:
        heads = [ids[-CONTEXT_TOKENS:] for ids in prompts]
        fulls = self.tokenizer.decode_batch([h + list(o) for h, o in zip(heads, outputs, strict=True)],
                                            skip_special_tokens=True)
        head_texts = self.tokenizer.decode_batch(heads, skip_special_tokens=True)
        texts = []
        for prompt, output, full, head_text in zip(prompts, outputs, fulls, head_texts, strict=True):
            if full.startswith(head_text) and not full.endswith(REPLACEMENT) and not head_text.endswith(REPLACEMENT):
                texts.append(full[len(head_text):])
            else:
                texts.append(self.stream(prompt, output))
        return texts

    def stream(self, prompt: list[int], output: Sequence[int]) -> str:
        """The slow, exact path: vLLM's own steps, a DecodeStream primed with the whole prompt."""
        from tokenizers.decoders import DecodeStream

        try:
            decoder = DecodeStream(ids=prompt, skip_special_tokens=True)
        except TypeError:  # tokenizers < 0.22: no priming argument, step through the prompt instead
            decoder = DecodeStream(skip_special_tokens=True)
            for token in prompt:
                decoder.step(self.tokenizer, token)
        return "".join(piece for token in output if (piece := decoder.step(self.tokenizer, token)) is not None)
