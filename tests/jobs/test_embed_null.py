"""`qbatch embed` through the real CLI with the null engine (fast: no model runs).

The null engine's vectors are a fixed function of the token ids, unnormalized, as a model's pooled
output is; the real engine runs the same paths in tests/engines/test_embed_engine.py.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qbatch.errors import EXIT_MISMATCH, EXIT_USAGE, InputError

HIDDEN = 576  # the bundled SmolLM2-135M's hidden size


@pytest.fixture
def embed_null(cli, bundled_model):
    def embed(*args):
        return cli("embed", *args, "--model", bundled_model, "--backend", "null", "--progress", "none")

    return embed


def vectors(out) -> np.ndarray:
    return np.stack(pl.read_parquet(out / "results.parquet")["embedding"].to_numpy())


def test_vectors_unit_norm_identical_texts_and_schema(embed_null, write_jsonl, tmp_path):
    texts = ["the cat sat", "a dog ran far away", "the cat sat", "x " * 40]
    rows = [{"id": f"r{i}", "prompt": t, "topic": i} for i, t in enumerate(texts)]
    out = tmp_path / "out"
    result = embed_null(write_jsonl(rows), "-o", out, "--chunk-tokens", 20)
    assert result.exit_code == 0, result.output
    assert "qbatch embed completed" in result.stdout and "input tok/s" in result.stdout
    schema = pq.read_schema(out / "results.parquet")
    assert schema.names == ["id", "source", "row_index", "prompt", "topic", "embedding", "prompt_tokens"]
    assert schema.field("embedding").type == pa.list_(pa.float32(), HIDDEN)  # a FixedSizeList
    df = pl.read_parquet(out / "results.parquet")
    assert df["id"].to_list() == ["r0", "r1", "r2", "r3"] and df["topic"].to_list() == [0, 1, 2, 3]
    v = vectors(out)
    assert v.shape == (4, HIDDEN)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(v[0], v[2]) and not np.allclose(v[0], v[1])
    assert (df["prompt_tokens"] > 0).all()
    assert len(list((out / "parts").glob("part-*.parquet"))) > 1  # token-budgeted on prompt tokens alone
    stats = json.loads((out / "stats.json").read_text())
    assert stats["task"] == "embed" and stats["completion_tokens"] == 0


def test_dimensions_truncate_then_renormalize_and_float16(embed_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": str(i), "prompt": f"text number {i}"} for i in range(5)])
    assert embed_null(path, "-o", tmp_path / "raw", "--no-normalize").exit_code == 0
    raw = vectors(tmp_path / "raw")
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)  # --no-normalize: the model's own vectors
    assert embed_null(path, "-o", tmp_path / "d32", "--dimensions", 32).exit_code == 0
    small = vectors(tmp_path / "d32")
    expected = raw[:, :32] / np.linalg.norm(raw[:, :32], axis=1, keepdims=True)
    assert small.shape == (5, 32) and np.allclose(small, expected, atol=1e-6)
    assert embed_null(path, "-o", tmp_path / "f16", "--dimensions", 32, "--embedding-dtype", "float16").exit_code == 0
    assert pq.read_schema(tmp_path / "f16" / "results.parquet").field("embedding").type == pa.list_(pa.float16(), 32)
    assert np.allclose(vectors(tmp_path / "f16").astype(np.float32), small, atol=1e-3)


def test_dimensions_above_the_hidden_size_stop_before_the_model_loads(embed_null, write_jsonl, tmp_path):
    result = embed_null(write_jsonl([{"prompt": "hi"}]), "-o", tmp_path / "out", "--dimensions", HIDDEN + 1)
    assert result.exit_code == EXIT_USAGE
    assert f"Error: dimensions must be at most the model's embedding size {HIDDEN}, got {HIDDEN + 1} (--dimensions)" \
        in result.output
    assert not (tmp_path / "out").exists()
    assert embed_null(write_jsonl([{"prompt": "hi"}]), "-o", tmp_path / "o2", "--dimensions", 0).exit_code == EXIT_USAGE


def test_changing_an_embedding_setting_is_refused_and_a_rerun_resumes(embed_null, write_jsonl, tmp_path):
    path, out = write_jsonl([{"id": str(i), "prompt": f"row {i}"} for i in range(6)]), tmp_path / "out"
    assert embed_null(path, "-o", out, "--dimensions", 16).exit_code == 0
    again = embed_null(path, "-o", out, "--dimensions", 16)
    assert again.exit_code == 0 and "rows already done               6" in again.stdout
    assert embed_null(path, "-o", out, "--dimensions", 8).exit_code == EXIT_MISMATCH


def test_bad_rows_become_error_rows_and_truncate_keeps_the_start(embed_null, write_jsonl, tmp_path):
    rows = [{"id": "ok", "prompt": "fine"}, {"id": "long", "prompt": "word " * 300}, {"id": "empty", "prompt": ""},
            {"id": "chat", "messages": [{"role": "user", "content": "hi"}]}, {"id": "num", "prompt": 5}]
    out = tmp_path / "out"
    result = embed_null(write_jsonl(rows), "-o", out, "--max-model-len", 64)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["ok"]
    errors = {r["id"]: r for r in pl.read_parquet(out / "errors.parquet").iter_rows(named=True)}
    assert {k: v["error"] for k, v in errors.items()} == {
        "long": "prompt_too_long", "empty": "empty_prompt", "chat": "unsupported_shape", "num": "bad_prompt"}
    assert errors["long"]["message"].startswith("input has 301 tokens but max_model_len is 64; pass --truncate")
    out2 = tmp_path / "out2"
    assert embed_null(write_jsonl(rows[:2], "t.jsonl"), "-o", out2, "--max-model-len", 64, "--truncate").exit_code == 0
    df = pl.read_parquet(out2 / "results.parquet")
    assert df["id"].to_list() == ["ok", "long"] and df["prompt_tokens"].to_list()[1] == 64


def test_instruction_prefixes_queries_in_qwen3_embeddings_format(embed_null, write_jsonl, tmp_path):
    out = tmp_path / "out"
    result = embed_null(write_jsonl([{"id": "q", "prompt": "what is a cat?"}]), "-o", out, "--include-prompt",
                        "--instruction", "Given a question, retrieve answers")
    assert result.exit_code == 0, result.output
    prompt = pl.read_parquet(out / "results.parquet")["prompt"][0]
    assert prompt == "Instruct: Given a question, retrieve answers\nQuery:what is a cat?"


def test_openai_embedding_lines_and_response_format(embed_null, write_jsonl, tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hello"}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["one", "two"]}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
        {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["solo"], "dimensions": 8}},
    ]
    out = tmp_path / "out"
    result = embed_null(write_jsonl(lines), "-o", out, "--dimensions", 8, "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    responses = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in responses}
    body = by_id["a"]["response"]["body"]
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    assert len(body["data"][0]["embedding"]) == 8 and body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert by_id["d"]["error"] is None
    assert by_id["b"]["error"]["code"] == "bad_body" and "2 inputs" in by_id["b"]["error"]["message"]
    assert by_id["c"]["error"] == {"code": "unsupported_url", "message": "url must be one of /v1/embeddings; got "
                                   "'/v1/chat/completions' (/v1/chat/completions lines need `qbatch run`)"}


def test_run_refuses_embedding_lines_with_the_command_that_takes_them(cli, bundled_model, write_jsonl, tmp_path):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}
    out = tmp_path / "out"
    result = cli("run", write_jsonl([line]), "-o", out, "--model", bundled_model, "--backend", "null",
                 "--progress", "none")
    assert result.exit_code == 0, result.output
    error = pl.read_parquet(out / "errors.parquet").row(0, named=True)
    assert error["error"] == "unsupported_url" and error["message"].endswith("(/v1/embeddings lines need `qbatch embed`)")


def test_generation_fingerprints_hold_no_embedding_settings(bundled_model, tmp_path):
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    generate = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "backend": "null"}))
    assert not {"task", "dimensions", "normalize", "embedding_dtype"} & set(generate.fingerprint().settings)
    embed = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "backend": "null",
                                         "task": "embed", "dimensions": 8}))
    assert embed.fingerprint().settings["task"] == "embed" and embed.fingerprint().settings["dimensions"] == 8


def test_duckdb_reads_the_vectors(embed_null, write_jsonl, tmp_path):
    duckdb = pytest.importorskip("duckdb")
    out = tmp_path / "out"
    assert embed_null(write_jsonl([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}]), "-o", out,
                      "--dimensions", 4).exit_code == 0
    rows = duckdb.sql(f"select id, len(embedding) from '{out / 'results.parquet'}' order by id").fetchall()
    assert rows == [("a", 4), ("b", 4)]


def test_session_embed_returns_vectors_in_input_order(bundled_model):
    import qbatch

    with qbatch.Session(bundled_model, backend="null") as session:
        df = session.embed(["alpha", "beta", "alpha"], dimensions=16, progress="none")
        assert df["id"].to_list() == ["0", "1", "2"] and df["embedding"].dtype == pl.Array(pl.Float32, 16)
        v = np.stack(df["embedding"].to_numpy())
        assert np.array_equal(v[0], v[2])
        with pytest.raises(InputError, match="1 rows could not be embedded; the first: empty_prompt"):
            session.embed(["ok", " "], progress="none")


def test_embeddings_travel_between_processes_as_messages():
    """Data-parallel workers and Ray actors send a chunk's embeddings back pickled, without their requests."""
    import pickle

    from qbatch.engines.messages import EmbeddingOutput, pack, unpack
    from qbatch.records import EMBED_SAMPLING, Embedding, Request

    requests = [Request(str(i), 0, i, [1, 2, i], dict(EMBED_SAMPLING), None) for i in range(3)]
    embeddings = [Embedding(requests[0], np.arange(4, dtype=np.float32), 2), Embedding(requests[1], None, error="no"),
                  Embedding(requests[2], np.ones(4, dtype=np.float32))]
    outputs = pickle.loads(pickle.dumps(pack(embeddings)))
    assert all(isinstance(o, EmbeddingOutput) for o in outputs)
    back = unpack(requests, outputs)
    assert [e.request.id for e in back] == ["0", "1", "2"] and back[1].error == "no" and back[0].num_cached_tokens == 2
    assert np.array_equal(back[0].vector, np.arange(4)) and requests[0].cost == 3  # prompt tokens alone


def test_progress_of_an_embedding_job_counts_input_tokens(cli, bundled_model, write_jsonl, tmp_path):
    path = write_jsonl([{"id": f"r{i}", "prompt": f"text number {i}"} for i in range(5)])
    result = cli("embed", path, "-o", tmp_path / "out", "--model", bundled_model, "--backend", "null",
                 "--progress", "log")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stderr.splitlines() if "5/5 rows" in line)
    assert "input tok/s" in line and not line.endswith(" 0 input tok/s")


def test_generation_settings_in_an_embedding_job_file_are_named_as_ignored(cli, bundled_model, write_jsonl, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("temperature = 0.2\nmax_tokens = 64\n")
    path = write_jsonl([{"id": "a", "prompt": "text"}])
    result = cli("embed", path, "-o", tmp_path / "out", "--job", job, "--model", bundled_model, "--backend", "null",
                 "--progress", "none")
    assert result.exit_code == 0, result.output
    assert "an embedding job generates nothing: max_tokens, temperature ignored" in result.stderr
