"""stats.json as a typed record (output/summary.py), the one reader of it for `qbatch status`, `qbatch
report` and the service's client: what an earlier qbatch wrote is written back byte for byte, an older
one's (fields missing) and a newer one's (fields this qbatch does not know) read."""

import json
import shutil
from pathlib import Path

import pytest

from qbatch.errors import OutputError
from qbatch.output.status import read_status
from qbatch.output.summary import Summary
from qbatch.report.data import collect

# A completed null run's stats.json, written by main at 46e030e (output_dir made /tmp/out)
WRITTEN_BEFORE = Path(__file__).parent / "data" / "stats_written_by_main.json"
NEWER_FIELDS = ("cached_tokens", "engine_choice", "adapters", "flags", "decode_context", "prefill_context",
                "roofline", "cost", "estimate", "parts", "samples_ok", "total_samples")


def _text(data: dict) -> str:
    return json.dumps(data, indent=2, default=str) + "\n"  # as _fs.atomic_write_json writes it


def test_a_stats_json_written_before_is_written_back_byte_for_byte(tmp_path):
    summary = Summary.read(WRITTEN_BEFORE)
    assert (summary.status, summary.rows_ok, summary.completion_tokens, summary.flags) == ("completed", 6, 48,
                                                                                           {"cut": 6})
    assert _text(summary.save()) == WRITTEN_BEFORE.read_text()
    assert Summary.read(tmp_path / "stats.json") is None


def _folder(tmp_path: Path, stats: dict) -> Path:
    """An output folder (only its manifest and stats.json: what status and report read of a run's numbers)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"status": "completed", "spec": {"model": "m"}}))
    (out / "stats.json").write_text(json.dumps(stats))
    return out


@pytest.mark.parametrize("age", ["older", "newer"])
def test_an_older_and_a_newer_stats_json_read_in_status_and_report(tmp_path, age):
    stats = json.loads(WRITTEN_BEFORE.read_text())
    if age == "older":  # before these fields were recorded
        stats = {key: value for key, value in stats.items() if key not in NEWER_FIELDS}
    else:
        stats.update(gpu_seconds=1.5, chunks=[{**stats["chunks"][0], "engine": 0}], rows_ok=6)
    out = _folder(tmp_path, stats)
    summary = Summary.read(out / "stats.json")
    assert summary.rows_ok == 6 and summary.output_tok_s == pytest.approx(48 / summary.generate_s)
    assert summary.flags == ({} if age == "older" else {"cut": 6}) and summary.cached_tokens == 0
    status = read_status(str(out))
    assert status["last_run"] == {"rows_ok": 6, "rows_failed": 0, "prompt_tokens": 400, "completion_tokens": 48,
                                  "generate_s": stats["generate_s"], "wall_s": stats["wall_s"],
                                  "output_tok_s": 7557.1, "total_tok_s": 70532.5}
    report = collect(out)
    assert report["stats"] == summary and report["chunks"]["rows"] == [6]
    assert report["glance"]["tok_s_source"] == "stats.json"


def test_a_damaged_field_of_the_record_is_named(tmp_path):
    """Every field is checked as its type says (derived from the record), not only those listed by hand."""
    out = _folder(tmp_path, {**json.loads(WRITTEN_BEFORE.read_text()), "decode_context": "many"})
    with pytest.raises(OutputError, match=r"stats.json is damaged: 'decode_context' is text, not an integer"):
        Summary.read(out / "stats.json")
