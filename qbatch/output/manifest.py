"""OUT_DIR/manifest.json as a typed record, read and written the same way by every module: a run's
(jobs/manifest.py: its fingerprint and spec, its status as it goes, the rows it read, the runs so far)
or a merge's (merge.py: the shards it was merged from).

The file's keys are the fields' names, in this order; a field that is None is not written (a merge
records no runs, an unfinished run no counts), except `limit` (null: no --limit) and a run's
`engine_choice` (null: the engine was not chosen for the job's shape). Keys this qbatch does not know
(a newer one's) are kept as they were read, after the others. Reading checks each field as its type
says (record_files.py), or as its metadata's SHAPE says where the type cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qbatch.output.fingerprint import Fingerprint
from qbatch.output.reading import ARROW_SCHEMA, MANIFEST_HINT, Values, read_checked
from qbatch.output.record_files import NOT_IN_FILE, SHAPE, load_record, save_record, shape_of

# The engines' plan (plan/record.py, a layer above) as output/recorded_plan.py reads it
PLAN_SHAPE = {"backend": str, "platform": str, "chosen_from_shape": (str, None),
              "placement": {"devices": [str], "engines": int, "engines_per_gpu": int, "mps": bool},
              "llm_args": Values({"reason": (str, None)}), "decisions": Values({"reason": (str, None)}),
              "env": [{"name": str, "value": (str, None), "reason": str, "rank": (int, None)}]}


@dataclass
class RunRecord:
    """One run of the folder's job: when it started and how it ended (finished or interrupted; neither:
    it failed, was killed, or still runs)."""

    started_at: str | None = None
    pid: int | None = None
    finished_at: str | None = None
    rows_ok: int | None = None
    rows_failed: int | None = None
    interrupted_at: str | None = None
    interrupted_by: str | None = None  # a signal's name, or a caller's stop reason


@dataclass
class InputRows:
    """Rows read from one input file, for `qbatch merge` to tell which shard read less."""

    path: str
    rows: int


@dataclass
class Manifest:
    created_at: str | None = None
    runs: list[RunRecord] = field(default_factory=list)  # the last MAX_RUNS, latest last
    qbatch_version: str | None = None
    status: str = "unknown"  # a run's: running, interrupted, failed, completed; a merge's: completed
    updated_at: str | None = None
    fingerprint: Fingerprint = field(default_factory=Fingerprint)
    spec: dict[str, Any] = field(default_factory=dict, metadata={SHAPE: {"model": str}})  # JobSpec.flat(), as JSON
    versions: dict[str, Any] | None = None
    limit: int | None = None
    model_path: str | None = None
    engine_choice: str | None = None
    # what the engines got and why (plan/record.py); older runs': none
    plan: dict[str, Any] | None = field(default=None, metadata={SHAPE: PLAN_SHAPE})
    rows_total: int | None = None
    input_rows: list[InputRows] | None = None
    covered_inputs: bool | None = None  # a completed run read every row of its inputs (no --limit stopped it)
    columns: dict[str, str] | None = None  # carried columns' types, readable (output/columns.py)
    column_schema: str | None = field(default=None, metadata={SHAPE: ARROW_SCHEMA})  # ... and exact, encoded
    result_schema: str | None = field(default=None, metadata={SHAPE: ARROW_SCHEMA})  # results.parquet's (schema.py)
    counts: dict[str, int] | None = None  # rows_ok, rows_failed, samples_ok: once completed
    merged_from: list[str] | None = None  # a merge's: its shards' folders
    extra: dict[str, Any] = field(default_factory=dict, metadata=NOT_IN_FILE)  # keys this qbatch does not know

    @property
    def model(self) -> str | None:
        """The model the spec named (its name or path as given)."""
        model = self.spec.get("model")
        return model if isinstance(model, str) else None

    @property
    def task(self) -> str | None:
        task = self.spec.get("task")
        return task if isinstance(task, str) else None

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """manifest.json, its fields checked (reading.py); None when there is none."""
        data = read_checked(path, MANIFEST_SHAPE, MANIFEST_HINT)
        return None if data is None else cls.load(data)

    @classmethod
    def load(cls, data: dict[str, Any]) -> Manifest:
        manifest = load_record(cls, data)
        manifest.extra = {key: value for key, value in data.items() if key not in MANIFEST_SHAPE}
        return manifest

    def save(self) -> dict[str, Any]:
        """The manifest as manifest.json holds it."""
        saved = {name: value for name, value in save_record(self, nulls=True).items()
                 if value is not None or self._null_written(name)}
        if self.merged_from is not None:  # a merge's: no runs
            del saved["runs"]
        return {**saved, **self.extra}

    def _null_written(self, name: str) -> bool:
        return name == "limit" or (name == "engine_choice" and self.merged_from is None)


MANIFEST_SHAPE = shape_of(Manifest)  # what Manifest.read checks, field by field
