"""`qbatch merge`: combine the outputs of `--shard I/N` runs into one results.parquet.

Shards are merged only when they ran the same job: same inputs, model and
result-changing settings, one shard each of the same N, all completed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qbatch.assemble import assemble
from qbatch.checkpoint import ERROR_PREFIX, RESULT_PREFIX, OutputDir, fingerprint_changes, read_json
from qbatch.errors import CheckpointMismatch, OutputError
from qbatch.spec import parse_shard


def merge(shard_dirs: list[str], output_dir: str, *, openai_jsonl: bool = False) -> dict[str, int]:
    """Assemble the shards' parts into OUTPUT_DIR; return row counts."""
    manifests = [_completed_manifest(Path(d)) for d in shard_dirs]
    _check_same_job(shard_dirs, manifests)
    _check_shards(shard_dirs, manifests)
    shards = [OutputDir(d) for d in shard_dirs]
    out = OutputDir(output_dir).open()
    try:
        counts = assemble(
            out, openai_jsonl=openai_jsonl,
            result_parts=[p for s in shards for p in s.part_files(RESULT_PREFIX)],
            error_parts=[p for s in shards for p in s.part_files(ERROR_PREFIX)],
            model=manifests[0].get("spec", {}).get("model"),
        )
        fingerprint = dict(manifests[0]["fingerprint"])
        fingerprint["settings"] = {**fingerprint["settings"], "shard": None}
        out.write_manifest({"status": "completed", "merged_from": [str(Path(d).resolve()) for d in shard_dirs],
                            "fingerprint": fingerprint, "counts": counts, "spec": manifests[0].get("spec", {})})
        return counts
    finally:
        out.close()


def _completed_manifest(folder: Path) -> dict[str, Any]:
    manifest = read_json(folder / "manifest.json")
    if manifest is None:
        raise OutputError("not a qbatch output folder (no manifest.json)", where=str(folder))
    if manifest.get("status") != "completed":
        raise OutputError(f"shard has not completed (status: {manifest.get('status')})", where=str(folder),
                          hint="rerun that shard's command; it resumes")
    return manifest


def _check_same_job(dirs: list[str], manifests: list[dict[str, Any]]) -> None:
    def without_shard(fingerprint: dict[str, Any]) -> dict[str, Any]:
        return {**fingerprint, "settings": {k: v for k, v in fingerprint["settings"].items() if k != "shard"}}

    first = without_shard(manifests[0]["fingerprint"])
    for folder, manifest in zip(dirs[1:], manifests[1:]):
        changes = fingerprint_changes(first, without_shard(manifest["fingerprint"]))
        if changes:
            raise CheckpointMismatch(f"shards ran different jobs: {'; '.join(changes)}", where=folder,
                                     hint="merge only the outputs of one job's --shard I/N runs")


def _check_shards(dirs: list[str], manifests: list[dict[str, Any]]) -> None:
    shards = [m["fingerprint"]["settings"].get("shard") for m in manifests]
    if None in shards:
        raise CheckpointMismatch("a folder was not run with --shard", where=dirs[shards.index(None)])
    parsed = [parse_shard(s) for s in shards]
    counts = {n for _, n in parsed}
    if len(counts) != 1:
        raise CheckpointMismatch(f"shards of different splits: {', '.join(shards)}")
    total = counts.pop()
    indexes = sorted(i for i, _ in parsed)
    if indexes != list(range(total)):
        missing = sorted(set(range(total)) - set(indexes))
        doubled = sorted({i for i in indexes if indexes.count(i) > 1})
        raise CheckpointMismatch(f"shards must be 0..{total - 1} once each; missing {missing}, repeated {doubled}",
                                 hint="pass every shard's output folder exactly once")
