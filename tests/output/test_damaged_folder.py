"""`qbatch status`, `report`, `merge` and a resumed `run` on an output folder whose files are damaged:
an error naming the file and how to recover (exit 1), never a traceback, never "no such file"."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qbatch.errors import EXIT_FATAL
from qbatch.output.reading import MANIFEST_HINT


def _half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(b"not what it should be \x00\xff")


def _folder(path: Path) -> None:  # unreadable as a file (root reads any file whatever its mode)
    path.unlink()
    path.mkdir()


def _text(text: str):
    return lambda path: path.write_text(text)


DAMAGES = {
    "manifest.json": {"not an object": _text("[]"), "text": _text('"x"'), "not JSON": _half, "unreadable": _folder,
                      "a field of the wrong type": _text('{"status": "completed", "spec": []}'),
                      "a count of the wrong type": _text('{"status": "completed", "rows_total": "12"}')},
    "stats.json": {"not an object": _text("[1]"), "not JSON": _garbage, "unreadable": _folder,
                   "chunks of the wrong type": _text('{"wall_s": 1.0, "chunks": 5}'),
                   "a chunk of the wrong type": _text('{"chunks": [{"finished_s": "soon"}]}')},
    "results.parquet": {"truncated": _half, "not Parquet": _garbage, "unreadable": _folder},
    "errors.parquet": {"truncated": _half, "not Parquet": _garbage},
    "telemetry.parquet": {"truncated": _half, "not Parquet": _garbage, "unreadable": _folder},
    "parts/part-000001.parquet": {"not Parquet": _garbage},
    "parts/errors-000001.parquet": {"truncated": _half},
}
CASES = [(name, kind) for name, kinds in DAMAGES.items() for kind in kinds]
# What reads each file: status reads a completed run's final files' footers and its parts, report every file.
COMMANDS = {"manifest.json": ("status", "report", "run"), "stats.json": ("status", "report"),
            "results.parquet": ("status", "report"), "errors.parquet": ("status", "report"),
            "telemetry.parquet": ("report",), "parts/part-000001.parquet": ("status", "run"),
            "parts/errors-000001.parquet": ("status", "run")}


@pytest.fixture(scope="module")
def completed(tmp_path_factory, bundled_model) -> tuple[Path, Path]:
    """A completed run's folder (results, errors, parts, stats, telemetry) and its input."""
    from qbatch.session import Session

    folder = tmp_path_factory.mktemp("completed")
    data = [{"id": "a", "prompt": "hello"}, {"id": "b", "prompt": ""}]
    with Session(bundled_model, backend="null") as session:
        session.run(data, output_dir=folder / "out", max_tokens=4, progress="none")
    assert (folder / "out" / "telemetry.parquet").is_file()
    return folder / "out", folder / "out" / "input.jsonl"


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}: {k}" for n, k in CASES])
def test_a_damaged_file_is_named_with_the_way_back(cli, completed, bundled_model, tmp_path, name, kind):
    source, data = completed
    out = tmp_path / "out"
    shutil.copytree(source, out)
    DAMAGES[name][kind](out / name)
    for command in COMMANDS[name]:
        args = {"status": ["status", out], "report": ["report", out, "-o", tmp_path / "r.html"],
                "run": ["run", data, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none",
                        "--max-tokens", "4"]}[command]
        result = cli(*args)  # an exception (a traceback) fails the test here
        assert result.exit_code == EXIT_FATAL, (command, result.output)
        error, hint = result.stderr.strip().splitlines()[-2:]
        assert error.startswith("Error: ") and f"({out / name})" in error, (command, error)
        assert hint.startswith("Hint: ") and "no telemetry" not in result.stderr, (command, hint)


def test_merge_names_a_damaged_shard_manifest(cli, tmp_path):
    shard = tmp_path / "shard"
    shard.mkdir()
    (shard / "manifest.json").write_text('{"fingerprint": {"settings": {"shard": 3}}}')
    result = cli("merge", shard, "-o", tmp_path / "all")
    assert result.exit_code == EXIT_FATAL
    assert "manifest.json is damaged: 'fingerprint.settings.shard' is an integer, not text" in result.stderr


@pytest.mark.parametrize("name", ["manifest.json", "stats.json"])
def test_a_file_this_user_may_not_read_is_named(cli, completed, monkeypatch, tmp_path, name):
    import errno
    import os

    out = tmp_path / "out"
    shutil.copytree(completed[0], out)
    read_text = Path.read_text

    def refused(path, *args, **kwargs):
        if path.name == name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)  # chmod cannot refuse root
    result = cli("status", out)
    assert result.exit_code == EXIT_FATAL
    assert result.stderr.splitlines()[-2:] == [
        f"Error: cannot read {name}: Permission denied ({out / name})",
        "Hint: this user may not read it: check the file's owner and permissions"]


def test_merge_names_a_damaged_part_of_a_shard(cli, bundled_model, write_jsonl, tmp_path):
    path = write_jsonl([{"id": f"r{i}", "prompt": "" if i % 2 else "hi"} for i in range(8)])
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, out in enumerate(shards):
        result = cli("run", path, "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none",
                     "--shard", f"{i}/2", "--max-tokens", "4")
        assert result.exit_code == 0, result.output
    part = sorted((shards[1] / "parts").glob("errors-*.parquet"))[0]
    _garbage(part)
    result = cli("merge", *shards, "-o", tmp_path / "all")
    assert result.exit_code == EXIT_FATAL
    assert f"Error: cannot read {part.name}: " in result.stderr and f"({part})" in result.stderr
    assert "Hint: delete that part (its rows will be redone) and rerun" in result.stderr


@pytest.mark.parametrize("schema", [["score"], {"score": "int64"}, "int64", "", 7, "c2NvcmU6IGludDY0"],
                         ids=["a list", "an object", "a type name", "empty", "a number", "base64 of no schema"])
@pytest.mark.parametrize("field", ["column_schema", "result_schema"])
def test_a_damaged_recorded_schema_names_the_field(cli, completed, bundled_model, tmp_path, field, schema):
    out = tmp_path / "out"
    shutil.copytree(completed[0], out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, field: schema}))
    result = cli("run", completed[1], "-o", out, "--model", bundled_model, "--backend", "null", "--progress", "none",
                 "--max-tokens", "4")
    assert result.exit_code == EXIT_FATAL, result.output
    error, hint = result.stderr.strip().splitlines()[-2:]
    assert error.startswith(f"Error: manifest.json is damaged: '{field}' is ") and f"({out / 'manifest.json'})" in error
    assert hint == f"Hint: {MANIFEST_HINT}"


# Objects whose fields qbatch records but reads only as a whole (compared, or shown): only the fields named here are read
OPAQUE = {("spec",): {"model"}, ("versions",): set(), ("fingerprint", "settings"): {"shard"}}


def _fields(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """The path of every field in a JSON value that qbatch reads (of a list, its first item's)."""
    items = value.items() if isinstance(value, dict) else enumerate(value[:1]) if isinstance(value, list) else ()
    for key, inner in items:
        if path in OPAQUE and key not in OPAQUE[path]:
            continue
        yield (*path, key)
        yield from _fields(inner, (*path, key))


def _wrong(value: Any) -> list[Any]:
    """Values of other kinds than `value`'s (a number for text, text for a number, a list for an object...)."""
    if isinstance(value, bool):
        return ["yes", 1]
    if isinstance(value, (int, float)):
        return ["12", [value]]
    if isinstance(value, str):
        return [7, [value]]
    if isinstance(value, dict):
        return [[value], "x"]
    if isinstance(value, list):
        return [{"0": value}, "x"]
    return [{}, "x"]


def _damaged(data: Any, path: tuple, wrong: Any) -> Any:
    """A copy of `data` with the field at `path` set to `wrong`, or removed (wrong is MISSING)."""
    data = copy.deepcopy(data)
    holder = data
    for key in path[:-1]:
        holder = holder[key]
    if wrong is MISSING:
        del holder[path[-1]]
    else:
        holder[path[-1]] = wrong
    return data


MISSING = object()


@pytest.mark.parametrize("damage", ["a wrong type", "missing"])
@pytest.mark.parametrize("name", ["manifest.json", "stats.json"])
def test_no_damaged_field_of_a_state_file_gives_a_traceback(cli, completed, bundled_model, tmp_path, name, damage):
    """Every field of the file (a list's first item's), in turn of another kind or removed: status, report
    and a resumed run either work or name the file (exit 1), never raise."""
    out = tmp_path / "out"
    shutil.copytree(completed[0], out)
    data = json.loads((out / name).read_text())
    commands = {"status": ["status", out], "report": ["report", out, "-o", tmp_path / "r.html"],
                "run": ["run", completed[1], "-o", out, "--model", bundled_model, "--backend", "null",
                        "--progress", "none", "--max-tokens", "4"]}
    raised, unnamed = [], []
    for path in _fields(data):
        for wrong in [MISSING] if damage == "missing" else _wrong(_at(data, path)):
            for command, args in commands.items():
                (out / name).write_text(json.dumps(_damaged(data, path, wrong)))
                try:
                    result = cli(*args)
                except Exception as exc:  # a traceback
                    raised.append((path, wrong, command, repr(exc)[:200]))
                    continue
                if result.exit_code == EXIT_FATAL and f"({out / name})" not in result.stderr:
                    unnamed.append((path, wrong, command, result.stderr[-300:]))
    assert not raised and not unnamed, (raised, unnamed)


def _at(data: Any, path: tuple) -> Any:
    for key in path:
        data = data[key]
    return data
