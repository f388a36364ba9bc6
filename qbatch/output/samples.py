"""Result columns of constrained, sampled and scored rows: one result row a sample, what the
answer parsed to, each token's logprobs, and each choice's probability.

Columns (added to a part only when one of its rows asked for them; assembly fills the rest with nulls):
- `sample_index` (int32): 0..n-1 when a row asked for n > 1 samples (0 for the other rows);
  a row's results are its id's rows, `(id, sample_index)` is their key.
- `parsed` (string): with a constraint, the answer (the text after the reasoning) when it
  parses: JSON re-serialized compactly, the choice, the regex's or grammar's text; else null.
- `parse_error` (string): why `parsed` is null (cut by max_tokens, invalid JSON, ...).
- `logprobs` (list of struct{token, logprob, top_logprobs: list of struct{token, logprob}}): one
  entry per generated token, the reasoning's included, in order; `top_logprobs` the N most likely.
- `choice_logprobs` (map string -> float64): with a choice constraint and logprobs, log P(choice).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pyarrow as pa

from qbatch.records import Completion

TOP_TYPE = pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64())]))
LOGPROBS_TYPE = pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64()), ("top_logprobs", TOP_TYPE)]))
CHOICE_LOGPROBS_TYPE = pa.map_(pa.string(), pa.float64())
COLUMN_TYPES = {"sample_index": pa.int32(), "parsed": pa.string(), "parse_error": pa.string(),
                "logprobs": LOGPROBS_TYPE, "choice_logprobs": CHOICE_LOGPROBS_TYPE}
CUT = "cut by max_tokens (finish_reason length) before the answer was complete"


def per_sample(completions: list[Completion]) -> tuple[list[Completion], list[int] | None]:
    """One completion a sample (in request order, samples in index order) and their sample indexes;
    None when every request asked for one sample."""
    if not any(c.more_samples for c in completions) and not any(c.request.sampling.get("n", 1) > 1
                                                               for c in completions):
        return completions, None
    flat: list[Completion] = []
    indexes: list[int] = []
    for c in completions:
        for i, s in enumerate(c.samples()):
            flat.append(Completion(c.request, s.text, s.finish_reason, s.num_completion_tokens,
                                   c.num_cached_tokens if i == 0 else 0, None, s.logprobs))
            indexes.append(i)
    return flat, indexes


def sample_columns(completions: list[Completion], answers: list[str | None]) -> dict[str, pa.Array]:
    """The parsed/parse_error, logprobs and choice_logprobs columns that the rows of a part asked for
    (`answers`: each completion's text after its reasoning)."""
    columns: dict[str, pa.Array] = {}
    constraints = [c.request.sampling.get("structured_outputs") for c in completions]
    if any(constraints):
        results = [parse(k, a, c.finish_reason) if k else (None, None)
                   for k, a, c in zip(constraints, answers, completions, strict=True)]
        columns["parsed"] = pa.array([p for p, _ in results], type=pa.string())
        columns["parse_error"] = pa.array([e for _, e in results], type=pa.string())
    if any(c.request.sampling.get("logprobs") is not None for c in completions):
        columns["logprobs"] = pa.array([c.logprobs for c in completions], type=LOGPROBS_TYPE)
        if any(k and "choice" in k for k in constraints):
            scores = [choice_logprobs(k["choice"], c) if k and "choice" in k and c.logprobs else None
                      for k, c in zip(constraints, completions, strict=True)]
            columns["choice_logprobs"] = pa.array([None if s is None else list(s.items()) for s in scores],
                                                  type=CHOICE_LOGPROBS_TYPE)
    return columns


def parse(constraint: dict[str, Any], answer: str | None, finish_reason: str | None) -> tuple[str | None, str | None]:
    """(parsed, parse_error) of an answer under its constraint: exactly one of them is null."""
    if not answer:
        return None, CUT if finish_reason == "length" else "no answer after the reasoning"
    if "json" in constraint or "json_object" in constraint:
        try:
            value = json.loads(answer)
        except json.JSONDecodeError as exc:
            return None, CUT if finish_reason == "length" else f"not valid JSON: {exc}"
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")), None
    if "choice" in constraint:
        return (answer, None) if answer in constraint["choice"] else (None, _why(finish_reason, "not one of the choices"))
    if "regex" in constraint:
        matched = re.fullmatch(constraint["regex"], answer) is not None
        return (answer, None) if matched else (None, _why(finish_reason, "does not match the regex"))
    # A grammar qbatch cannot check: the engine held the output to it, so a finished answer is taken.
    return (answer, None) if finish_reason != "length" else (None, CUT)


def _why(finish_reason: str | None, reason: str) -> str:
    return CUT if finish_reason == "length" else reason


def choice_logprobs(choices: list[str], completion: Completion) -> dict[str, float] | None:
    """log P(choice) for each choice, from the answer's first token's top logprobs.

    Under a choice constraint the engine masks every token that starts no choice before it computes
    logprobs, so the first answer token's alternatives are the choices' possible first tokens and
    their probabilities sum to 1. A choice's probability is the sum over the alternatives whose text
    starts it and starts no other choice. When an alternative starts several choices (choices that
    share a first token, e.g. "pos"/"positive"), the first token does not decide: the row gets null
    (score such labels with distinct first words, or by prompt logprobs). Alternatives that --top-logprobs
    did not list count as 0: ask for at least as many as there are choices.
    """
    tokens = completion.logprobs or []
    start = _answer_start(tokens, completion.request.thinking)
    if start is None:
        return None
    mass = dict.fromkeys(choices, 0.0)
    for alt in tokens[start]["top_logprobs"]:
        text = alt["token"]
        if not text or alt["logprob"] is None:
            continue
        owners = [c for c in choices if c.startswith(text)]
        if len(owners) > 1:
            return None
        if owners:
            mass[owners[0]] += math.exp(alt["logprob"])
    return {c: (math.log(p) if p > 0 else -math.inf) for c, p in mass.items()}


def _answer_start(tokens: list[dict[str, Any]], thinking: bool | None) -> int | None:
    """The position of the answer's first token: after `</think>` and the whitespace that follows it."""
    start = 0
    if thinking:
        ends = [i for i, t in enumerate(tokens) if t["token"] == "</think>"]
        if not ends:
            return None
        start = ends[-1] + 1
    while start < len(tokens) and not tokens[start]["token"].strip():
        start += 1
    return start if start < len(tokens) else None
