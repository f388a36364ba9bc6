"""`qbatch embed` on the real engine: the 2-layer random Qwen3 as an embedding model (vLLM's pooling
runner, convert="embed"). Every in-process test runs with the same engine settings, so they share one
engine; the kill test runs the CLI in subprocesses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 256  # tiny_qwen3's hidden size
ENGINE_ARGS = ("--max-num-seqs", 32, "--progress", "none")


@pytest.fixture
def embed_real(cli, tiny_qwen3):
    def embed(*args):
        return cli("embed", *args, "--model", tiny_qwen3, *ENGINE_ARGS)

    return embed


def vectors(out: Path) -> np.ndarray:
    return np.stack(pl.read_parquet(out / "results.parquet")["embedding"].to_numpy())


def test_vectors_norms_identical_texts_bad_rows_and_vllms_own_embed(embed_real, engine_pool, write_jsonl, tmp_path):
    texts = ["the cat sat on the mat", "stocks fell sharply today", "the cat sat on the mat", "word " * 40]
    rows = [{"id": f"r{i}", "prompt": t} for i, t in enumerate(texts)]
    rows += [{"id": "long", "prompt": "word " * 5000}, {"id": "empty", "prompt": ""},
             {"id": "chat", "messages": [{"role": "user", "content": "hi"}]}]
    out = tmp_path / "out"
    result = embed_real(write_jsonl(rows), "-o", out)
    assert result.exit_code == 0, result.output
    assert pq.read_schema(out / "results.parquet").field("embedding").type == pa.list_(pa.float32(), HIDDEN)
    v = vectors(out)
    assert v.shape == (4, HIDDEN) and np.isfinite(v).all()
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.allclose(v[0], v[2], atol=1e-5) and not np.allclose(v[0], v[1], atol=1e-2)
    errors = dict(pl.read_parquet(out / "errors.parquet").select("id", "error").iter_rows())
    assert errors == {"long": "prompt_too_long", "empty": "empty_prompt", "chat": "unsupported_shape"}

    # The same vectors as vLLM's own LLM.embed (its default pooling, normalized) on the same engine
    [engine] = [e for e in engine_pool.engines() if getattr(e, "embeds", False)]
    ids = pl.read_parquet(out / "results.parquet")["prompt_tokens"].to_list()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.llm.llm_engine.model_config.tokenizer)
    prompts = [{"prompt_token_ids": tokenizer(t)["input_ids"]} for t in texts]
    assert [len(p["prompt_token_ids"]) for p in prompts] == ids
    theirs = np.array([o.outputs.embedding for o in engine.llm.embed(prompts, use_tqdm=False)], dtype=np.float32)
    assert np.allclose(v, theirs, atol=1e-4)


def test_matryoshka_dimensions_and_no_normalize(embed_real, write_jsonl, tmp_path):
    path = write_jsonl([{"id": str(i), "prompt": f"sentence number {i} about things"} for i in range(6)])
    assert embed_real(path, "-o", tmp_path / "raw", "--no-normalize").exit_code == 0
    raw = vectors(tmp_path / "raw")
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    result = embed_real(path, "-o", tmp_path / "d64", "--dimensions", 64, "--embedding-dtype", "float16")
    assert result.exit_code == 0, result.output
    small = vectors(tmp_path / "d64").astype(np.float32)
    expected = raw[:, :64] / np.linalg.norm(raw[:, :64], axis=1, keepdims=True)
    assert small.shape == (6, 64) and np.allclose(small, expected, atol=2e-3)


def test_openai_embedding_lines(embed_real, write_jsonl, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny", "input": f"text {i}"}} for i in range(3)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", "b"]}})
    out = tmp_path / "out"
    result = embed_real(write_jsonl(lines), "-o", out, "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    responses = {r["custom_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert sorted(responses) == ["bad", "c0", "c1", "c2"]
    data = responses["c1"]["response"]["body"]["data"]
    assert len(data) == 1 and len(data[0]["embedding"]) == HIDDEN
    assert abs(np.linalg.norm(data[0]["embedding"]) - 1.0) < 1e-4
    assert responses["bad"]["error"]["code"] == "bad_body"
