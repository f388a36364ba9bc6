"""`--shard I/N` splits rows by id hash; `qbatch merge` puts the shards back together."""

from __future__ import annotations

import json

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


@pytest.fixture
def two_shards(cli, bundled_model, write_jsonl, tmp_path):
    """Both shards of a 60-row input, completed; run(shard, *extra) reruns one."""
    path = write_jsonl([{"id": f"r{i}", "prompt": f"p{i}"} for i in range(60)])

    def run(shard, *extra):
        out = tmp_path / f"s{shard[0]}"
        result = cli("run", path, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none",
                     "--shard", shard, *extra)
        assert result.exit_code == 0, result.output
        return out

    run.input = path
    run.outs = [run("0/2"), run("1/2")]
    return run


def test_merge_refuses_a_shard_that_read_fewer_appended_rows_in_either_order(cli, two_shards, tmp_path):
    with open(two_shards.input, "a") as handle:
        handle.write("".join(json.dumps({"id": f"n{i}", "prompt": "x"}) + "\n" for i in range(3)))
    two_shards("1/2")  # only shard 1 catches up
    s0, s1 = two_shards.outs
    answers = [cli("merge", *order, "-o", tmp_path / "all") for order in ([s0, s1], [s1, s0])]
    for result in answers:
        assert result.exit_code == EXIT_MISMATCH
        assert result.stderr == answers[0].stderr
        assert f"Error: shard 0/2 ({s0}) read in.jsonl before 3 rows were appended" in result.stderr
        assert "Hint: rerun its command to catch up, then merge again" in result.stderr
    assert not (tmp_path / "all" / "results.parquet").exists()
    two_shards("0/2")
    result = cli("merge", s1, s0, "-o", tmp_path / "all")
    assert result.exit_code == 0, result.output
    assert "63 results, 0 errors" in result.stdout


def test_merge_refuses_a_shard_run_with_limit(cli, two_shards, tmp_path):
    s0, s1 = two_shards.outs
    two_shards("1/2", "--restart", "--limit", "10")
    result = cli("merge", s0, s1, "-o", tmp_path / "all")
    assert result.exit_code == EXIT_MISMATCH
    assert f"Error: shard 1/2 ({s1}) ran with --limit 10, so it did not cover its inputs" in result.stderr
    assert "Hint: rerun its command without --limit (it resumes), then merge again" in result.stderr
    two_shards("1/2")
    assert cli("merge", s0, s1, "-o", tmp_path / "all").exit_code == 0


def test_merge_refuses_an_unfinished_shard_whatever_the_order(cli, two_shards, tmp_path):
    s0, s1 = two_shards.outs
    for folder in (s0, s1):
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    first, second = (cli("merge", *order, "-o", tmp_path / "all") for order in ([s0, s1], [s1, s0]))
    assert first.exit_code == second.exit_code == EXIT_MISMATCH and first.stderr == second.stderr
    assert f"Error: shard 0/2 ({s0}) has not completed (status: running)" in first.stderr


def test_merge_refuses_a_shard_whose_parts_were_removed(cli, two_shards, tmp_path):
    s0, s1 = two_shards.outs
    next((s1 / "parts").glob("part-*.parquet")).unlink()
    result = cli("merge", s0, s1, "-o", tmp_path / "all")
    assert result.exit_code == EXIT_MISMATCH
    expected = json.loads((s1 / "manifest.json").read_text())["counts"]["rows_ok"]
    assert f"Error: shard 1/2 ({s1}) holds 0 results in parts/ but completed with {expected}" in result.stderr


@pytest.mark.parametrize("inside", ["", "merged"])
def test_merge_never_writes_into_a_shard(cli, two_shards, inside):
    s0, s1 = two_shards.outs
    before = {p: p.read_bytes() for p in s1.rglob("*") if p.is_file()}
    result = cli("merge", s0, s1, "-o", s1 / inside)
    assert result.exit_code == 2
    assert f"Error: the merge output {s1 / inside} is a shard's folder or inside one ({s1})" in result.stderr
    assert {p: p.read_bytes() for p in s1.rglob("*") if p.is_file()} == before


def test_merge_refuses_shards_that_read_different_versions_of_an_input(cli, two_shards, tmp_path):
    two_shards.input.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"new {i}"}) + "\n" for i in range(60)))
    two_shards("1/2", "--restart")
    s0, s1 = two_shards.outs
    for order in ([s0, s1], [s1, s0]):
        result = cli("merge", *order, "-o", tmp_path / "all")
        assert result.exit_code == EXIT_MISMATCH
        assert f"Error: shard 1/2 ({s1}) read another version of in.jsonl than shard 0/2 ({s0})" in result.stderr
        assert "Hint: rerun every shard on the same input (with --restart where a rerun refuses)" in result.stderr


def test_merge_refuses_an_output_folder_that_holds_a_run(cli, two_shards, shard_run):
    other = shard_run("0/3")
    result = cli("merge", *two_shards.outs, "-o", other)
    assert result.exit_code == 1
    assert f"Error: the merge output folder holds a qbatch run, not a merge ({other})" in result.stderr
