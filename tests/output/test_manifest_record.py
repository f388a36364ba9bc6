"""manifest.json as a typed record (output/manifest.py): what an earlier qbatch wrote is read and written
back with the same keys, in the same order, byte for byte; keys it does not know are kept."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from qbatch.errors import OutputError
from qbatch.output.manifest import InputRows, Manifest, RunRecord
from qbatch.output.reading import ARROW_SCHEMA, Needed, Values
from qbatch.output.record_files import NOT_IN_FILE, SHAPE, shape_of

# A completed null run's manifest.json, written by qbatch before the record (main at 0b40086)
WRITTEN_BEFORE = Path(__file__).parent / "data" / "manifest_written_by_main.json"


def _text(data: dict) -> str:
    return json.dumps(data, indent=2, default=str) + "\n"  # as _fs.atomic_write_json writes it


def test_a_manifest_written_before_the_record_is_written_back_byte_for_byte():
    text = WRITTEN_BEFORE.read_text()
    manifest = Manifest.load(json.loads(text))
    assert manifest.status == "completed" and manifest.limit is None and manifest.engine_choice is None
    assert manifest.runs == [RunRecord(started_at="2026-12-05T01:37:58+0000", pid=26817,
                                       finished_at="2026-12-05T01:37:58+0000", rows_ok=16, rows_failed=0)]
    assert manifest.input_rows == [InputRows("/tmp/types_in.jsonl", 16)]
    assert manifest.fingerprint.inputs[0].path == "/tmp/types_in.jsonl"
    assert _text(manifest.save()) == text


def test_an_interrupted_run_and_keys_this_qbatch_does_not_know_are_kept():
    data = json.loads(WRITTEN_BEFORE.read_text())
    data["runs"].append({"started_at": "2026-12-05T02:00:00+0000", "pid": 1, "interrupted_at": "2026-12-05T02:00:09+0000",
                         "interrupted_by": "SIGTERM"})
    data["status"] = "interrupted"
    del data["counts"]  # an unfinished first run: none yet
    data["from_a_newer_qbatch"] = {"engines": 2}
    manifest = Manifest.load(data)
    assert manifest.runs[-1].interrupted_by == "SIGTERM" and manifest.counts is None
    assert _text(manifest.save()) == _text(data)


def test_a_merge_records_no_run_fields():
    merged = Manifest(status="completed", merged_from=["/a", "/b"], counts={"rows_ok": 2, "rows_failed": 0},
                      spec={"model": "m"}, input_rows=[InputRows("/in.jsonl", 2)], limit=None, covered_inputs=True)
    assert list(merged.save()) == ["status", "fingerprint", "spec", "limit", "input_rows", "covered_inputs", "counts",
                                   "merged_from"]
    assert Manifest.load(merged.save()) == merged


def test_every_field_of_the_record_is_checked_as_its_type_says(tmp_path):
    """The file's shape is derived from the records (record_files.shape_of): a field no list names is checked too,
    and a damaged one is named with its place."""
    data = json.loads(WRITTEN_BEFORE.read_text())
    data["runs"][0]["pid"] = "26817"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(OutputError, match=r"manifest.json is damaged: 'runs\[0\].pid' is text, not an integer"):
        Manifest.read(tmp_path / "manifest.json")
    assert Manifest.read(WRITTEN_BEFORE).save() == json.loads(WRITTEN_BEFORE.read_text())


@dataclass
class _Inner:
    name: str
    size: int = 0


@dataclass
class _Record:
    inner: _Inner
    count: int | None = None
    tags: list[str] = field(default_factory=list)
    sizes: dict[str, float] = field(default_factory=dict)
    anything: dict[str, Any] = field(default_factory=dict)
    encoded: str = field(default="", metadata={SHAPE: ARROW_SCHEMA})
    held: tuple[_Inner, ...] = field(default=(), metadata=NOT_IN_FILE)


def test_a_record_s_shape_is_read_from_its_fields():
    assert shape_of(_Record) == {"inner": Needed({"name": Needed(str), "size": int}), "count": (int, None),
                                 "tags": [str], "sizes": Values(float), "anything": dict, "encoded": ARROW_SCHEMA}
