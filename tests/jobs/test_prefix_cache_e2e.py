"""The real engine reuses a document's cached prefix when its questions run together (--order
longest-first) and computes it again for each question when they are scattered (longest-first-flat)."""

from __future__ import annotations

import json
import random

import polars as pl
import pytest

from tests.jobs.test_run_e2e import TINY_ENGINE  # its engine, shared

pytestmark = pytest.mark.slow


def test_grouped_questions_hit_vllms_prefix_cache(cli, tiny_qwen3, write_jsonl, tmp_path):
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "lambda", "theta", "zeta"]
    # Every document the same words shuffled: one token count, so the length sort orders the rows by their
    # questions' lengths and scatters each document's questions.
    bag = [words[i % len(words)] for i in range(500)]
    docs = ["Document: " + " ".join(rng.sample(bag, len(bag))) for _ in range(24)]
    rows = [{"id": f"d{d}q{q}", "prompt": f"{docs[d]}\n\nQuestion: " + " ".join(rng.choices(words, k=rng.randrange(1, 40)))}
            for d in range(24) for q in range(4)]
    rng.shuffle(rows)
    path = write_jsonl(rows)
    cached = {}
    for order in ("longest-first", "longest-first-flat"):
        out = tmp_path / order
        # a KV cache of a few sequences (TINY_ENGINE): a scattered document is evicted before its next question
        result = cli("run", path, "-o", out, "--model", tiny_qwen3, "--max-tokens", 1, "--order", order, *TINY_ENGINE)
        assert result.exit_code == 0, result.output
        results = pl.read_parquet(out / "results.parquet")
        assert results.height == 96
        cached[order] = results["cached_tokens"].sum() / results["prompt_tokens"].sum()
        stats = json.loads((out / "stats.json").read_text())  # the run's summary counts the same hits
        assert (stats["cached_tokens"], stats["prompt_tokens"]) == (results["cached_tokens"].sum(),
                                                                    results["prompt_tokens"].sum())
        assert f"{cached[order]:.0%} of input from the prefix cache" in result.output
    # Three questions of four find their document cached when they run together (0.60 of the prompt tokens
    # cached, measured); scattered, the small cache has often evicted it by the next one (0.27).
    assert cached["longest-first"] > 0.5 and cached["longest-first"] > 2 * cached["longest-first-flat"], cached
