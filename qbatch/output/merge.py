"""`qbatch merge`: combine the outputs of `--shard I/N` runs into one results.parquet.

Shards are merged only when they ran the same job on the same inputs and each
covered them completely: same model and result-changing settings, one shard
each of the same N, all completed without --limit, every shard's input
identities equal (compared as whole values) and its results still in its parts.
Shards are checked in shard order, so the answer never depends on the order of
the arguments. The merge never writes into a shard's folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qbatch.output.assemble import assemble
from qbatch.output.fingerprint import Fingerprint, InputIdentity, input_change, input_identity, paths_change
from qbatch.output.folder import ERROR_PREFIX, RESULT_PREFIX, OutputDir
from qbatch.output.manifest import InputRows, Manifest
from qbatch.output.schema import from_manifest as result_schema_of
from qbatch.output.schema import to_manifest as schema_to_manifest
from qbatch.errors import CheckpointMismatch, LockedError, OutputError, SpecError
from qbatch.spec import parse_shard

RERUN = "rerun its command (it resumes), then merge again"


@dataclass(frozen=True)
class Shard:
    """One shard's output folder as its manifest describes it."""

    folder: str
    manifest: Manifest
    index: int
    total: int

    @property
    def fingerprint(self) -> Fingerprint:
        return self.manifest.fingerprint

    @property
    def input_rows(self) -> list[InputRows]:
        return self.manifest.input_rows or []  # checked by _check_finished

    @property
    def name(self) -> str:
        return f"shard {self.index}/{self.total} ({self.folder})"


def merge(shard_dirs: list[str], output_dir: str, *, openai_jsonl: bool = False,
          shard_names: list[str | None] | None = None) -> dict[str, int]:
    """Assemble the shards' parts into OUTPUT_DIR; return row counts. `shard_names`: what the manifest records
    a shard as where it is not its folder's path (None: the path), the URL of an object store's folder."""
    _check_output_folder(output_dir, shard_dirs)
    shards = _read_shards(shard_dirs)
    _check_split(shards)
    for shard in shards:
        _check_finished(shard)
    _check_same_job(shards)
    _check_same_inputs(shards)
    for shard in shards:
        _check_parts(shard)
    folders = [OutputDir(s.folder) for s in shards]
    out = OutputDir(output_dir).open()
    try:
        assembled = assemble(
            out, openai_jsonl=openai_jsonl,
            result_parts=[p for s in folders for p in s.part_files(RESULT_PREFIX)],
            error_parts=[p for s in folders for p in s.part_files(ERROR_PREFIX)],
            model=shards[0].manifest.model, manifest=shards[0].manifest,
        )
        first = shards[0].manifest
        schema = result_schema_of(first.result_schema)
        out.write_manifest(Manifest(
            status="completed", merged_from=_names(shards, shard_dirs, shard_names),
            fingerprint=shards[0].fingerprint.without_shard(), counts=assembled.counts, spec=first.spec,
            input_rows=first.input_rows, limit=None, covered_inputs=True,
            result_schema=None if schema is None else schema_to_manifest(schema)))
        return assembled.counts  # the manifest counts rows; results.parquet's flag column holds the flags
    finally:
        out.close()


def _check_output_folder(output_dir: str, shard_dirs: list[str]) -> None:
    """The merge writes only into a folder of its own: never a shard's, nor a run's."""
    target = Path(output_dir).resolve()
    for folder in sorted(shard_dirs):
        shard = Path(folder).resolve()
        if target == shard or shard in target.parents:
            raise SpecError(f"the merge output {output_dir} is a shard's folder or inside one",
                            where=folder, hint="pass another -o/--output-dir, e.g. a sibling of the shards' folders")
    manifest = Manifest.read(target / "manifest.json")
    if manifest is not None and manifest.merged_from is None:
        raise OutputError("the merge output folder holds a qbatch run, not a merge", where=output_dir,
                          hint="pass an empty folder (or an earlier merge's folder) with -o/--output-dir")


def _read_shards(shard_dirs: list[str]) -> list[Shard]:
    """The shards, in shard order (then folder), whatever the order they were passed in."""
    shards = []
    for folder in sorted(shard_dirs):
        manifest = Manifest.read(Path(folder) / "manifest.json")
        if manifest is None:
            raise OutputError("not a qbatch output folder (no manifest.json)", where=folder,
                              hint="pass the -o folders of `qbatch run --shard I/N` runs")
        shard = manifest.fingerprint.shard
        if shard is None:
            raise CheckpointMismatch("a folder was not run with --shard", where=folder,
                                     hint="merge only the outputs of one job's --shard I/N runs")
        index, total = parse_shard(shard)
        shards.append(Shard(folder, manifest, index, total))
    return sorted(shards, key=lambda s: (s.index, s.folder))


def _check_split(shards: list[Shard]) -> None:
    totals = {s.total for s in shards}
    if len(totals) != 1:
        splits = ", ".join(f"{s.index}/{s.total}" for s in shards)
        raise CheckpointMismatch(f"shards of different splits: {splits}",
                                 hint="merge only the outputs of one job's --shard I/N runs")
    total = totals.pop()
    indexes = [s.index for s in shards]
    if indexes != list(range(total)):
        missing = sorted(set(range(total)) - set(indexes))
        doubled = sorted({i for i in indexes if indexes.count(i) > 1})
        raise CheckpointMismatch(f"shards must be 0..{total - 1} once each; missing {missing}, repeated {doubled}",
                                 hint="pass every shard's output folder exactly once")


def _check_finished(shard: Shard) -> None:
    """Not in use by a live run, completed, and every row of the inputs read."""
    holder = OutputDir(shard.folder).lock_holder()
    if holder:
        raise LockedError(f"a qbatch run is using {shard.name} ({holder})",
                          hint="wait for it to finish, then merge again")
    manifest = shard.manifest
    if manifest.status != "completed":
        raise CheckpointMismatch(f"{shard.name} has not completed (status: {manifest.status})", hint=RERUN)
    if manifest.covered_inputs is None or manifest.input_rows is None:
        raise CheckpointMismatch(f"{shard.name} was run by a qbatch that did not record whether it read all its "
                                 "inputs", hint=RERUN)
    if not manifest.covered_inputs:
        raise CheckpointMismatch(f"{shard.name} ran with --limit {manifest.limit}, so it did not cover its "
                                 "inputs", hint="rerun its command without --limit (it resumes), then merge again")


def _check_same_job(shards: list[Shard]) -> None:
    """Same model and result-changing settings; the same input files (their contents: _check_same_inputs)."""
    first = shards[0]
    for shard in shards[1:]:
        changes = first.fingerprint.as_job().changes(shard.fingerprint.as_job())
        paths, first_paths = _input_paths(shard), _input_paths(first)
        if paths != first_paths:
            changes.append(paths_change(first_paths, paths))
        if changes:
            raise CheckpointMismatch(f"shards ran different jobs: {'; '.join(changes)}", where=shard.folder,
                                     hint="merge only the outputs of one job's --shard I/N runs")


def _input_paths(shard: Shard) -> list[str]:
    return [entry.path for entry in shard.input_rows]


def _check_same_inputs(shards: list[Shard]) -> None:
    """Every shard read each input in the same state; else name the shards that read it in another."""
    for position in range(len(shards[0].input_rows)):
        # The reference is the shard that read the most rows of this input (the first such shard).
        ahead = max(shards, key=lambda s: _rows(s, position))
        behind = [s for s in shards if _identity(s, position) != _identity(ahead, position)]
        if not behind:
            continue
        name = Path(ahead.input_rows[position].path).name
        missing = {s.index: _rows(ahead, position) - _rows(s, position) for s in behind}
        if all(missing[s.index] > 0 and _only_appended(_identity(s, position), _identity(ahead, position))
               for s in behind):
            whose = "its command" if len(behind) == 1 else "those shards' commands"
            problems = [f"{s.name} read {name} before {_rows_were(missing[s.index])} appended" for s in behind]
            raise CheckpointMismatch("; ".join(problems), hint=f"rerun {whose} to catch up, then merge again")
        raise CheckpointMismatch(
            f"{', '.join(s.name for s in behind)} read another version of {name} than {ahead.name}",
            hint="rerun every shard on the same input (with --restart where a rerun refuses), then merge again")


def _names(shards: list[Shard], shard_dirs: list[str], shard_names: list[str | None] | None) -> list[str]:
    """Each shard as the merged manifest records it: its name where given, else its folder's resolved path."""
    given = dict(zip(shard_dirs, shard_names or [], strict=False))
    return [given.get(s.folder) or str(Path(s.folder).resolve()) for s in shards]


def _rows_were(count: int) -> str:
    return "1 row was" if count == 1 else f"{count} rows were"


def _only_appended(old: InputIdentity, new: InputIdentity) -> bool:
    """Whether the shard that read `old` saw a prefix of the file the other read as `new` (appended
    rows, not another version): told from the file as it is now, when it is still `new`."""
    if old.size >= new.size:
        return False
    try:
        now = input_identity(Path(new.path), new.format, seen_size=old.size, size=new.size)
    except OSError:  # the input is gone or unreadable now: it cannot be told
        return False
    return now.sha256 == new.sha256 and input_change(old, now) is None


def _rows(shard: Shard, position: int) -> int:
    return shard.input_rows[position].rows


def _identity(shard: Shard, position: int) -> InputIdentity:
    """An input's identity as recorded, compared as one whole value (its fields are the fingerprint's business)."""
    return shard.fingerprint.inputs[position]


def _check_parts(shard: Shard) -> None:
    """The results a shard completed with are still in its parts (the merge reads the parts)."""
    expected = (shard.manifest.counts or {}).get("rows_ok")
    found = len(OutputDir(shard.folder).result_ids())
    if found != expected:
        raise CheckpointMismatch(f"{shard.name} holds {found} results in parts/ but completed with {expected}",
                                 hint="its parts changed after it completed: " + RERUN)
