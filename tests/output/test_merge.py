"""`--shard I/N` splits rows by id hash; `qbatch merge` puts the shards back together."""

from __future__ import annotations

import polars as pl
import pytest

from qbatch.errors import EXIT_MISMATCH


@pytest.fixture
def shard_run(cli, bundled_model, write_jsonl, tmp_path):
    path = write_jsonl([{"id": f"r{i}", "prompt": f"p{i}"} for i in range(60)])

    def run(shard, *extra):
        out = tmp_path / f"shard-{shard.replace('/', 'of')}"
        result = cli("run", path, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none",
                     "--shard", shard, *extra)
        assert result.exit_code == 0, result.output
        return out

    return run


def test_shards_are_disjoint_and_merge_to_the_whole(cli, shard_run, tmp_path):
    outs = [shard_run(f"{i}/3") for i in range(3)]
    sizes = [pl.read_parquet(o / "results.parquet").height for o in outs]
    assert sum(sizes) == 60 and all(s > 0 for s in sizes)
    result = cli("merge", *outs, "-o", tmp_path / "all")
    assert result.exit_code == 0, result.output
    assert "merged 3 shards" in result.stdout and "60 results, 0 errors" in result.stdout
    merged = pl.read_parquet(tmp_path / "all" / "results.parquet")
    assert merged["id"].to_list() == [f"r{i}" for i in range(60)]  # input order restored


def test_merge_refuses_mismatched_or_missing_shards(cli, shard_run, tmp_path):
    a = shard_run("0/2")
    b = shard_run("1/2", "--max-tokens", "7")
    result = cli("merge", a, b, "-o", tmp_path / "all")
    assert result.exit_code == EXIT_MISMATCH and "shards ran different jobs: max_tokens was 2048, now 7" in result.stderr
    result = cli("merge", a, "-o", tmp_path / "all")
    assert result.exit_code == EXIT_MISMATCH and "missing [1]" in result.stderr
