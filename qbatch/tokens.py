"""How a prompt's text becomes token ids: one rule for the driver, which counts a prompt's tokens, and for
the engines, which send them to vLLM.

A generated row travels from the driver to its engine as its text (`PromptText`), not as its token ids:
the driver tokenizes every prompt to plan (lengths, budgets, max_model_len), but turning the tokenizer's
ids into Python ints and pickling them cost its one Python thread more than the rest of a long prompt's
work (docs/benchmarks.md, the coordinator's ceiling). The engine's process encodes the text again by the
same rule (`TextEncoder`), its own cores doing it, and checks the count the driver planned with.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

from qbatch.errors import EngineError, ModelError, first_line
from qbatch.records import PromptText, Request

_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(path: str, revision: str | None = None) -> Any:
    """The model's fast tokenizer (no engine needed).

    Cached per (path, revision): a warm Session's next run must not load it again.
    The tokenizer is shared, so callers must not change it (use a copy to set a template).
    One thread loads at a time: the service's first online requests come on many threads at once,
    and Transformers' lazy import is not thread-safe (a second thread importing it midway got
    "cannot import name 'AutoTokenizer'"); the others then find it in the cache.
    """
    with _TOKENIZER_LOCK:
        return _load_tokenizer(path, revision)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, revision: str | None) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except Exception as exc:  # hub/IO/format errors all mean "cannot load"
        raise ModelError(
            f"cannot load the tokenizer of model '{path}': {first_line(exc, 300)}",
            hint="pass a local model folder, or --model smollm2-135m (bundled, works offline)",
        ) from None


class TextEncoder:
    """A tokenizer's batch encoding: the fast tokenizer's Rust batch encoder, which uses every core and
    releases the GIL, where it gives `tokenizer(...)`'s ids; `tokenizer(...)` itself otherwise.

    Skipping transformers' per-text wrapping of `tokenizer(list)` (attention masks, dicts) makes
    tokenization faster; the backend is used only after it gave the same ids as `tokenizer(...)`
    on the first texts, for each value of add_special_tokens.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._backend_agrees: dict[bool, bool] = {}

    def encode(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[Any]:
        """Each text's encoding: a tokenizers.Encoding (`len()` its count, `.ids` its ids) or a list of ids."""
        texts = list(texts)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        # without the characters' offsets, which no caller reads: the encoding is faster, and freeing its
        # encodings (a string a token) costs a seventh (docs/benchmarks.md, the coordinator's ceiling)
        encode_batch = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
        if encode_batch is not None and add_special_tokens not in self._backend_agrees:
            sample = texts[:8]
            self._backend_agrees[add_special_tokens] = (
                [e.ids for e in encode_batch(sample, add_special_tokens=add_special_tokens)]
                == self.tokenizer(sample, add_special_tokens=add_special_tokens)["input_ids"])
        if encode_batch is not None and self._backend_agrees[add_special_tokens]:
            encoded: list[Any] = encode_batch(texts, add_special_tokens=add_special_tokens)
            return encoded
        ids: list[Any] = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return ids

    def ids(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        return [ids_of(e) for e in self.encode(texts, add_special_tokens=add_special_tokens)]


def ids_of(encoded: Any) -> list[int]:
    """An encoding's token ids (TextEncoder.encode gives a tokenizers.Encoding or a list of ids)."""
    ids: list[int] = encoded if isinstance(encoded, list) else encoded.ids
    return ids


def encode_prompts(requests: Sequence[Request], encoder: TextEncoder) -> None:
    """Give each request that carries its prompt as text (PromptText) its token ids, in one batch call per
    kind of text; a count other than the driver's is an error, not a row's: the driver and the engines
    loaded different tokenizers, and every row's plan (budget, max_tokens) was made with the driver's."""
    for special in (False, True):
        kept = [r for r in requests if isinstance(r.tokens, PromptText) and r.tokens.add_special_tokens is special]
        if not kept:
            continue
        encoded = encoder.ids([r.tokens.text for r in kept if isinstance(r.tokens, PromptText)],
                              add_special_tokens=special)
        for request, ids in zip(kept, encoded, strict=True):
            if len(ids) != len(request.tokens):
                raise EngineError(
                    f"row {request.id}: the engine's tokenizer gives {len(ids)} tokens where the driver's gave "
                    f"{len(request.tokens)}", hint="the driver and every engine must load the same model folder "
                                                    "(on a Ray cluster: the same files on every node)")
            request.tokens = ids
