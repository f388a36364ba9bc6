"""An input that changed is refused before any row is processed; one that only grew resumes.

Every test runs the whole pipeline through the CLI with the null engine. The large
files put the edited bytes past the first MiB and before the last 64 KiB, where a
hash of the file's start and end alone does not look.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pytest

from qbatch.errors import EXIT_MISMATCH

MIDDLE = {"id": "b", "prompt": "say hi"}
EDITED = {"id": "x", "prompt": "say yo"}  # same length as MIDDLE



def big_jsonl(path: Path, middle: dict) -> Path:
    """Three rows, ~1.3 MB: the middle one starts 1.1 MB in and ends 200 KB before the end."""
    rows = [{"id": "a", "prompt": "one", "pad": "x" * 1_100_000}, middle,
            {"id": "c", "prompt": "three", "pad": "y" * 200_000}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_refused(result, path: Path) -> None:
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert f"input {path.resolve()} changed (not only appended to)" in result.stderr
    assert "Hint: rerun with --restart" in result.stderr


def test_a_row_edited_in_the_middle_of_a_large_file_is_refused(run_null_short, tmp_path):
    path, out = big_jsonl(tmp_path / "in.jsonl", MIDDLE), tmp_path / "out"
    assert run_null_short(path, "-o", out).exit_code == 0
    size = path.stat().st_size
    big_jsonl(path, EDITED)
    assert path.stat().st_size == size
    assert_refused(run_null_short(path, "-o", out), path)
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b", "c"]  # nothing mixed in


def test_a_truncated_file_is_refused(run_null_short, write_jsonl, tmp_path):
    path, out = write_jsonl([{"id": i, "prompt": f"p{i}"} for i in range(10)]), tmp_path / "out"
    assert run_null_short(path, "-o", out, "--limit", 3).exit_code == 0
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:9]))
    result = run_null_short(path, "-o", out)
    assert_refused(result, path)
    assert "shrank" in result.stderr


def test_rows_appended_to_a_large_file_resume_and_only_they_are_processed(run_null_short, tmp_path):
    path, out = big_jsonl(tmp_path / "in.jsonl", MIDDLE), tmp_path / "out"
    assert run_null_short(path, "-o", out).exit_code == 0
    with open(path, "a") as handle:
        handle.write(json.dumps({"id": "d", "prompt": "four"}) + "\n")
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              1" in result.stdout
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b", "c", "d"]


def test_rows_appended_after_a_last_line_without_newline_are_refused(run_null_short, tmp_path):
    """The first appended bytes would extend the old last row: that row changed."""
    path, out = tmp_path / "in.jsonl", tmp_path / "out"
    path.write_text(json.dumps({"id": "a", "prompt": "one"}) + "\n" + json.dumps({"id": "b", "prompt": "two"}))
    assert run_null_short(path, "-o", out).exit_code == 0
    with open(path, "a") as handle:
        handle.write(json.dumps({"id": "c", "prompt": "three"}) + "\n")
    result = run_null_short(path, "-o", out)
    assert_refused(result, path)
    assert "did not end with a newline" in result.stderr


def test_a_rewritten_parquet_file_is_refused(run_null_short, tmp_path):
    """Same size, same footer statistics: one prompt changed in the middle of the file."""
    import random

    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefgh") for _ in range(40)) for _ in range(40_000)]
    path, out = tmp_path / "in.parquet", tmp_path / "out"

    def write() -> None:
        pl.DataFrame({"id": [str(i) for i in range(len(prompts))], "prompt": prompts}).write_parquet(
            path, compression="uncompressed", statistics=False)

    write()
    assert path.stat().st_size > 1_300_000
    assert run_null_short(path, "-o", out, "--limit", 2).exit_code == 0
    size = path.stat().st_size
    prompts[20_000] = prompts[20_000][::-1]
    write()
    assert path.stat().st_size == size
    assert_refused(run_null_short(path, "-o", out), path)


def test_a_changed_gzip_file_is_refused_even_when_it_grew(run_null_short, tmp_path):
    """A compressed file may not grow: its appended bytes are not appended rows."""
    path, out = tmp_path / "in.jsonl.gz", tmp_path / "out"
    lines = [json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(5)]
    path.write_bytes(gzip.compress("".join(lines).encode()))
    assert run_null_short(path, "-o", out).exit_code == 0
    path.write_bytes(gzip.compress("".join(lines[:2] + [json.dumps({"id": 9, "prompt": "p2"}) + "\n"]
                                            + lines[3:]).encode()))
    assert_refused(run_null_short(path, "-o", out), path)
    with open(path, "ab") as handle:  # a second gzip member: gzip reads it as more rows
        handle.write(gzip.compress(json.dumps({"id": 5, "prompt": "p5"}).encode() + b"\n"))
    assert_refused(run_null_short(path, "-o", out), path)


def test_an_unchanged_input_resumes_without_redoing_rows(run_null_short, write_jsonl, tmp_path):
    path, out = write_jsonl([{"id": i, "prompt": f"p{i}"} for i in range(6)]), tmp_path / "out"
    assert run_null_short(path, "-o", out, "--limit", 2).exit_code == 0
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows already done               2" in result.stdout and "rows ok (this run)              4" in result.stdout


def test_source_is_one_absolute_path_whatever_the_working_directory(run_null_short, tmp_path, monkeypatch):
    """A run from one folder, resumed from another with another spelling of the same file."""
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = data / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "one"}, {"id": "bad", "text": "no prompt"}, {"id": "c", "prompt": "three"},
        {"id": "bad2", "text": "no prompt"}]))
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    assert run_null_short("data/in.jsonl", "-o", out, "--limit", 2).exit_code == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = run_null_short("../data/./in.jsonl", "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows already done               2" in result.stdout
    assert set(pl.read_parquet(out / "results.parquet")["source"]) == {str(path.resolve())}
    assert pl.read_parquet(out / "errors.parquet")["source"].to_list() == [str(path.resolve())] * 2


def test_rows_inserted_before_the_end_are_refused(run_null_short, write_jsonl, tmp_path):
    """The file grew, but not at its end: the bytes the last run read differ."""
    path, out = write_jsonl([{"id": i, "prompt": f"p{i}"} for i in range(4)]), tmp_path / "out"
    assert run_null_short(path, "-o", out).exit_code == 0
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + [json.dumps({"id": 9, "prompt": "inserted"}) + "\n"] + lines[2:]))
    result = run_null_short(path, "-o", out)
    assert_refused(result, path)
    assert f"its first {sum(map(len, lines)):,} bytes (what the last run read) differ" in result.stderr


@pytest.mark.parametrize("seen_size", [0, 1, 7, 8, 9, 16, 23])
def test_the_prefix_hash_of_one_pass_equals_the_old_files_hash(tmp_path, monkeypatch, seen_size):
    """Whatever block the previous size falls in (block size 8 here), including its edges."""
    from qbatch.output import fingerprint as checkpoint

    monkeypatch.setattr(checkpoint, "HASH_BLOCK_BYTES", 8)
    data = bytes(range(30))
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_bytes(data[:seen_size])
    new.write_bytes(data)
    grown = checkpoint.input_identity(new, "jsonl", seen_size=seen_size)
    assert grown.prefix == checkpoint.InputPrefix(seen_size, checkpoint.input_identity(old, "jsonl").sha256,
                                                  line_ended=False)  # the byte after the prefix is no newline
    assert grown.sha256 == checkpoint.input_identity(new, "jsonl").sha256 and grown.size == 30


def test_a_fingerprint_reads_back_as_it_was_saved(tmp_path):
    """manifest.json keeps the fingerprint as before the typed records (no prefix); every reader loads it so."""
    from qbatch.output.fingerprint import Fingerprint, input_identity
    from qbatch.output.record_files import load_record, save_record

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n')
    saved = save_record(Fingerprint({"max_tokens": 8, "shard": "0/2"}, {"name": "m"}, (input_identity(path, "jsonl"),)))
    assert list(saved) == ["settings", "model", "inputs"]
    assert list(saved["inputs"][0]) == ["path", "format", "size", "sha256", "ends_with_newline"]
    loaded = load_record(Fingerprint, saved)
    assert save_record(loaded) == saved and loaded.shard == "0/2" and loaded.without_shard().shard is None
    assert loaded.seen_sizes() == {str(path.resolve()): path.stat().st_size}
    assert Fingerprint().changes(loaded)[0] == "max_tokens was None, now 8"


def test_a_half_written_last_line_is_left_for_the_next_run(run_null_short, tmp_path):
    """A cron run that reads the file while its writer is mid-line: the unfinished line is no row and no
    error (a log line says so); once the writer ends it, the next run resumes and reads it."""
    path, out = tmp_path / "in.jsonl", tmp_path / "out"
    path.write_text(json.dumps({"id": "a", "prompt": "one"}) + '\n{"id": "b", "pro')
    for flags in ([], ["--on-bad-line", "skip"]):
        result = run_null_short(path, "-o", out, *flags)
        assert result.exit_code == 0, result.output
        assert f"the last line of {path.resolve()} has no newline and is not complete JSON" in result.stderr
        assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a"]
        assert pl.read_parquet(out / "errors.parquet").is_empty()
    with open(path, "a") as handle:
        handle.write('mpt": "two"}\n' + json.dumps({"id": "c", "prompt": "three"}) + "\n")
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              2" in result.stdout
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b", "c"]


def test_a_last_line_without_newline_is_a_row_and_its_newline_then_counts_as_an_append(run_null_short, tmp_path):
    path, out = tmp_path / "in.jsonl", tmp_path / "out"
    path.write_text(json.dumps({"id": "a", "prompt": "one"}) + "\n" + json.dumps({"id": "b", "prompt": "two"}))
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b"]  # the final row is not lost
    with open(path, "a") as handle:
        handle.write("\n" + json.dumps({"id": "c", "prompt": "three"}) + "\n")
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              1" in result.stdout
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["a", "b", "c"]


def test_a_file_added_to_a_folder_of_10000_is_said_in_a_line(run_null_short, tmp_path):
    """The refusal counts the inputs added and removed and names the first few: it listed every file (680 kB)."""
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    for i in range(10_000):
        (folder / f"f{i:05d}.jsonl").write_text(f'{{"id": "r{i}", "prompt": "p"}}\n')
    assert run_null_short(folder, "-o", out, "--limit", 1).exit_code == 0
    (folder / "g.jsonl").write_text('{"id": "new", "prompt": "p"}\n')
    result = run_null_short(folder, "-o", out)
    assert result.exit_code == EXIT_MISMATCH, result.output
    assert len(result.stderr) < 1000
    assert f"inputs were 10,000 files, now 10,001: 1 input added ({folder / 'g.jsonl'}) ({out})" in result.stderr
    assert "Hint: rerun with --restart to start this output over, or use a different -o/--output-dir" in result.stderr


def test_a_mismatch_names_the_first_few_inputs_and_counts_the_rest():
    from qbatch.output.fingerprint import Fingerprint, InputIdentity

    def inputs(names, sha="a"):
        return tuple(InputIdentity(f"/in/{name}", "jsonl", 10, sha) for name in names)

    old = Fingerprint(inputs=inputs(range(10_000)))
    assert old.changes(Fingerprint(inputs=inputs(range(7, 10_000)))) == [
        "inputs were 10,000 files, now 9,993: 7 inputs removed (/in/0, /in/1, /in/2, /in/3, /in/4 and 2 more)"]
    assert old.changes(Fingerprint(inputs=inputs([*range(1, 10_000), "x"]))) == [
        "inputs were 10,000 files, now 10,000: 1 input added (/in/x), 1 input removed (/in/0)"]
    assert old.changes(Fingerprint(inputs=inputs(reversed(range(10_000))))) == [
        "the same 10,000 inputs in another order"]
    changed = old.changes(Fingerprint(inputs=inputs(range(10_000), sha="b")))
    assert len(changed) == 6 and changed[-1] == "and 9,995 more inputs changed"
    assert changed[0] == "input /in/0 changed (not only appended to): same size (10 bytes), different content"
