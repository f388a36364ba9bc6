"""Synthetic benchmark workloads: prompt and output lengths, and prompts of exactly those lengths.

Prompts are random whole-word tokens of the model's own tokenizer, rendered
through its chat template exactly as `qbatch run` renders them, so the raw vLLM
modes (text or token ids) and qbatch (a JSONL file) get the same prompts.
A row's user message is a list of segments; segments with the same key have the
same words, so rows that share leading segments (one instruction, one document)
share that token prefix, as real jobs do (issue #19).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qbatch.errors import SpecError

WORKLOADS = ("uniform", "varied", "short", "small", "classify", "classify-choice", "classify-json",
             "prefill", "prefill-short", "prefill-mix", "extract-json", "longgen", "docqa", "docqa-large", "docqa-shared", "embed")
EMBED_WORKLOADS = ("embed",)  # run on an embedding engine (`qbatch embed`, LLM.embed): texts in, no output tokens
# The classification workloads (issue #20): the same rows free, under a 5-label choice, and under a
# small JSON schema; constrained rows stop when their answer is complete (no ignore_eos: the grammar
# ends them), up to max_tokens.
LABELS = ["billing", "bug", "feature", "praise", "other"]
CONSTRAINTS: dict[str, dict[str, Any] | None] = {
    "classify": None,
    "classify-choice": {"choice": LABELS},
    "classify-json": {"json": {"type": "object", "properties": {"label": {"type": "string", "enum": LABELS},
                                                                 "urgent": {"type": "boolean"}},
                               "required": ["label", "urgent"], "additionalProperties": False}},
    "extract-json": {"json": {"type": "object", "properties": {"customer": {"type": "string", "maxLength": 40},
                                                                 "amount": {"type": "number"},
                                                                 "refund": {"type": "boolean"}},
                              "required": ["customer", "amount", "refund"], "additionalProperties": False}},
}
CLASSIFY_MAX_TOKENS = 32
DEFAULT_WORKLOADS = ("uniform", "varied", "short")  # what `qbatch bench` runs unless --workloads says
# Issue #19's shapes. prefill: one instruction shared by every row (at the start of the user message)
# then a document of its own. docqa: documents asked several questions each, document first so the
# rows of one document share its tokens as a prefix; (tokens per document, questions per document, output tokens).
# docqa-shared: issue #57's shared-document job (1,500 documents x 6 questions, 24 tokens out).
PREFILL_INSTRUCTION_TOKENS = 370
# Issue #34's other prefill-heavy shapes, each one instruction shared by every row then a text of its
# own: (instruction tokens, the chat template's included, the text's (mean, low, high) tokens, lognormal, output tokens).
# prefill-short: a short instruction over short texts (a sentiment or topic label); prefill-mix: texts
# of very mixed lengths; extract-json: a small JSON object taken out of a document (the grammar ends
# the row, up to its output tokens).
PREFILL_SHAPES = {"prefill-short": (80, (120, 20, 400), 4), "prefill-mix": (200, (700, 50, 4000), 8),
                  "extract-json": (120, (600, 300, 900), 48)}
DOCQA_SHAPES = {"docqa": (800, 8, 16), "docqa-large": (1500, 4, 16), "docqa-shared": (1500, 6, 24)}
WORD_POOL_SIZE = 4000


def sample_lengths(name: str, num_rows: int, *, seed: int = 0, scale: float = 1.0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per row; prompt lengths include the chat template.

    uniform: 512 / 256. varied: lognormal, means ~300 (16..2048) / ~215 (8..1024).
    short: ~200 (150..250) / 1..8, a classification-like job. prefill-short, prefill-mix, extract-json:
    PREFILL_SHAPES. small: ~190 (170..210) / 256, the
    notebook-sized job a warm Session serves (200 rows by default). prefill: ~820 (a shared ~370
    instruction + ~450 of its own) / 8. longgen: ~155 (130..180) / lognormal ~715 (64..2048).
    docqa: a ~800-token document + a ~20-token question / 16; docqa-large: ~1500 + ~20 / 16;
    docqa-shared: ~1500 + ~20 / 24, six questions a document.
    embed: passages of a search corpus, lognormal ~256 (16..1024) tokens of raw text (no chat
    template) / 0. `scale` shrinks every segment and output (CPU smoke runs); shared prefixes stay shared.
    """
    return [(sum(length for _, length in segments), output)
            for segments, output in sample_rows(name, num_rows, seed=seed, scale=scale)]


Segment = tuple[str, int]  # (key, tokens): segments with one key have the same words


def sample_rows(name: str, num_rows: int, *, seed: int = 0, scale: float = 1.0
                ) -> list[tuple[tuple[Segment, ...], int]]:
    """Each row's user-message segments (in order) and its output tokens; the chat template's tokens
    count in the first segment (make_workload takes them off it, the same for every row sharing it)."""
    if name not in WORKLOADS:
        raise SpecError(f"workload must be one of {', '.join(WORKLOADS)}; got '{name}'")
    if name in DOCQA_SHAPES:
        return _docqa_rows(name, num_rows, seed, scale)
    rng = random.Random(f"{name.split('-')[0]}:{seed}")
    rows: list[tuple[tuple[Segment, ...], int]] = []
    for i in range(num_rows):
        if name == "uniform":
            prompt, output = 512, 256
        elif name == "varied":
            prompt = _lognormal(rng, 300, 16, 2048)
            output = _lognormal(rng, 215, 8, 1024)
        elif name == "short":
            prompt, output = rng.randint(150, 250), rng.randint(1, 8)
        elif name.startswith("classify"):  # the same lengths for its three variants
            prompt, output = rng.randint(150, 250), CLASSIFY_MAX_TOKENS
        elif name == "prefill":
            rows.append(((("instruction", _scaled(PREFILL_INSTRUCTION_TOKENS, scale)),
                          (f"document{i}", _scaled(rng.randint(400, 500), scale))), _scaled(8, scale)))
            continue
        elif name in PREFILL_SHAPES:
            instruction, (mean, low, high), output = PREFILL_SHAPES[name]
            rows.append(((("instruction", _scaled(instruction, scale)),
                          (f"text{i}", _scaled(_lognormal(rng, mean, low, high), scale))), _scaled(output, scale)))
            continue
        elif name == "longgen":
            prompt, output = rng.randint(130, 180), _lognormal(rng, 715, 64, 2048, sigma=0.6)
        elif name == "embed":  # no output tokens
            rows.append((((f"row{i}", _scaled(_lognormal(rng, 256, 16, 1024), scale)),), 0))
            continue
        else:  # small
            prompt, output = rng.randint(170, 210), 256
        rows.append((((f"row{i}", _scaled(prompt, scale)),), _scaled(output, scale)))
    return rows


def _docqa_rows(name: str, num_rows: int, seed: int, scale: float) -> list[tuple[tuple[Segment, ...], int]]:
    """Documents of ~mean tokens (75%..125%) asked `questions` questions each (the last one fewer when
    num_rows says so), in a seeded shuffle: an export's rows of one document are scattered."""
    mean, questions, output = DOCQA_SHAPES[name]
    rng = random.Random(f"{name}:{seed}")
    num_docs = -(-num_rows // questions)
    docs = [_scaled(rng.randint(mean * 3 // 4, mean * 5 // 4), scale) for _ in range(num_docs)]
    rows: list[tuple[tuple[Segment, ...], int]] = [(((f"document{i // questions}", docs[i // questions]), (f"question{i}", _scaled(rng.randint(15, 25), scale))),
             _scaled(output, scale)) for i in range(num_rows)]
    random.Random(f"{name}:{seed}:order").shuffle(rows)
    return rows


def _scaled(tokens: int, scale: float) -> int:
    return max(1, round(tokens * scale))


def _lognormal(rng: random.Random, mean: float, low: int, high: int, sigma: float = 0.8) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))


@dataclass
class Workload:
    """Rows as qbatch reads them (`texts`) and as raw vLLM gets them (`prompts`, `prompt_token_ids`)."""

    name: str
    texts: list[str]  # the user message of each row
    prompts: list[str]  # rendered through the chat template, exactly as qbatch renders it
    prompt_token_ids: list[list[int]]
    max_tokens: list[int]
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams kwargs, every row
    groups: list[str] | None = None  # docqa: each row's document (the vllm-grouped mode sorts by it)
    task: str = "generate"  # "embed": texts as they are (no chat template), embedded

    @property
    def num_rows(self) -> int:
        return len(self.texts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompt_token_ids))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def write_jsonl(self, path: Path) -> Path:
        with open(path, "w", encoding="utf-8") as handle:
            for i, (text, max_tokens) in enumerate(zip(self.texts, self.max_tokens, strict=True)):
                row = {"id": f"{self.name}-{i}", "prompt": text, "max_tokens": max_tokens}
                if self.task == "embed":  # no output: no max_tokens column to carry to the results
                    del row["max_tokens"]
                if self.structured_outputs is not None:  # the grammar ends the row: no ignore_eos
                    row.update(structured_outputs=self.structured_outputs, ignore_eos=False)
                handle.write(json.dumps(row) + "\n")
        return path

    def describe(self) -> dict[str, Any]:
        n = max(1, self.num_rows)
        return {"rows": self.num_rows, "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
                "mean_prompt_tokens": round(self.num_prompt_tokens / n, 1),
                "mean_output_tokens": round(self.num_output_tokens / n, 1)}


def make_workload(name: str, tokenizer: Any, num_rows: int, *, seed: int = 0, scale: float = 1.0) -> Workload:
    """Rows of random single-token words sized so the chat-templated prompt has the sampled length."""
    rows = sample_rows(name, num_rows, seed=seed, scale=scale)
    pool = word_pool(tokenizer)
    if name in EMBED_WORKLOADS:
        return _embed_workload(name, tokenizer, pool, [sum(n for _, n in segments) for segments, _ in rows], seed)
    overhead = len(encode_ids(tokenizer, [render_chat(tokenizer, [pool[0]])[0]])[0]) - 1
    rng = random.Random(f"{name.split('-')[0]}:{seed}:words")  # classify's variants: the same prompts
    words: dict[str, str] = {}  # a segment's words, drawn where its key first appears
    texts = []
    for segments, _ in rows:
        for position, (key, length) in enumerate(segments):
            if key not in words:  # the template's tokens come off the first segment
                words[key] = " ".join(rng.choices(pool, k=max(1, length - (overhead if position == 0 else 0))))
        texts.append(" ".join(words[key] for key, _ in segments))
    prompts = render_chat(tokenizer, texts)
    groups = [segments[0][0] for segments, _ in rows] if name in DOCQA_SHAPES else None
    return Workload(name, texts, prompts, encode_ids(tokenizer, prompts), [output for _, output in rows],
                    CONSTRAINTS.get(name), groups)


def _embed_workload(name: str, tokenizer: Any, pool: list[str], lengths: list[int], seed: int) -> Workload:
    """Raw texts of the sampled lengths, token ids as `qbatch embed` and LLM.embed make them (the
    tokenizer's special tokens included)."""
    rng = random.Random(f"{name}:{seed}:words")
    overhead = len(tokenizer(pool[0])["input_ids"]) - 1
    texts = [" ".join(rng.choices(pool, k=max(1, length - overhead))) for length in lengths]
    return Workload(name, texts, texts, tokenizer(texts)["input_ids"], [0] * len(texts), task="embed")


def word_pool(tokenizer: Any, size: int = WORD_POOL_SIZE) -> list[str]:
    """Lowercase words that are one token both alone and after a space, most frequent first."""
    candidates = []
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = token[1:] if token[:1] in ("Ġ", "▁") else ""
        if word.isascii() and word.isalpha() and word.islower() and 3 <= len(word) <= 10:
            candidates.append(word)
    alone = encode_ids(tokenizer, candidates)
    spaced = encode_ids(tokenizer, [" " + w for w in candidates])
    pool = [w for w, a, s in zip(candidates, alone, spaced, strict=True) if len(a) == 1 and len(s) == 1][:size]
    if len(pool) < 100:
        raise SpecError("the tokenizer has too few whole-word tokens to build synthetic prompts")
    return pool


def render_chat(tokenizer: Any, texts: list[str]) -> list[str]:
    if not getattr(tokenizer, "chat_template", None):
        return list(texts)
    return list(tokenizer.apply_chat_template([[{"role": "user", "content": t}] for t in texts], tokenize=False,
                                              add_generation_prompt=True))


def encode_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
