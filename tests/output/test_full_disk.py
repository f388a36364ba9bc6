"""A disk that fills up while a run assembles its results: the error names the file that could not be
written and says why, no temporary file stays, the parts stay, and the same command, once there is
space, assembles every row."""

from __future__ import annotations

import errno
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from qbatch.errors import EXIT_FATAL

DISK_FULL = "parquet: File out of specification: underlying IO error: No space left on device (os error 28)"


@pytest.fixture
def disk_fills_at(monkeypatch):
    """disk_fills_at(out, name): the disk of `out` fills up as OUT_DIR/name is written: polars' writes fail as
    they do on a full disk (a ComputeError naming the OS error, part of the file written), pyarrow's as it
    does (an OSError, errno 28), and so does every later write of a file of `out`."""

    def fill(out: Path, name: str) -> None:
        full = []
        sink_parquet, write_text = pl.LazyFrame.sink_parquet, Path.write_text

        def sink(frame, path, *args, **kwargs):
            if Path(path).name.startswith(name) or full:
                full.append(name)
                Path(path).write_bytes(b"PAR1 torn")
                raise pl.exceptions.ComputeError(DISK_FULL)
            return sink_parquet(frame, path, *args, **kwargs)

        def text(path, *args, **kwargs):
            if full and out in path.parents:
                path.write_bytes(b"")  # the file is made, then nothing fits
                raise OSError(errno.ENOSPC, "No space left on device")
            return write_text(path, *args, **kwargs)

        def write_table(writer, table, *args, **kwargs):  # results.parquet goes a range at a time (ranges.py)
            if Path(writer.where).name.startswith(name) or full:
                full.append(name)
                raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
            return write_range(writer, table, *args, **kwargs)

        write_range = pq.ParquetWriter.write_table
        monkeypatch.setattr(pl.LazyFrame, "sink_parquet", sink)
        monkeypatch.setattr(pq.ParquetWriter, "write_table", write_table)  # pyarrow's error on a full disk
        monkeypatch.setattr(Path, "write_text", text)

    return fill


@pytest.mark.parametrize("name", ["results.parquet", "errors.parquet"])
def test_a_full_disk_during_assembly_names_the_file_and_leaves_no_temp(run_null_short, write_jsonl, disk_fills_at,
                                                                        monkeypatch, tmp_path, name):
    path = write_jsonl([{"id": f"r{i}", "prompt": "" if i == 3 else f"say {i}"} for i in range(6)])
    out = tmp_path / "out"
    disk_fills_at(out, name)
    result = run_null_short(path, "-o", out)
    assert result.exit_code == EXIT_FATAL, result.output
    assert result.stderr.strip().splitlines()[-2:] == [
        f"Error: cannot write {name}: the disk is full ({out / name})",
        "Hint: finished parts are intact: free space and rerun the same command to resume"]
    assert not list(out.rglob("*.tmp-*"))
    assert list((out / "parts").glob("part-*.parquet"))
    monkeypatch.undo()  # space freed
    result = run_null_short(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert sorted(pl.read_parquet(out / "results.parquet")["id"]) == [f"r{i}" for i in range(6) if i != 3]
    assert pl.read_parquet(out / "errors.parquet")["id"].to_list() == ["r3"]
