"""Inputs in an object store (s3://, gs://, hf://): an object, a folder (its .jsonl/.ndjson/.parquet objects)
or a glob, copied into OUT_DIR/inputs/remote/ before the run reads them.

A run reads its inputs more than once (the hash of the fingerprint, the id pre-scan, the run itself) and
Parquet seeks, so each object is downloaded once, streamed to disk a block at a time (memory stays bounded
whatever its size; the disk holds a copy), and read there as a local file. A copy whose object kept its
ETag and size is reused. The run records each input under its URL (fingerprint, `source` column), and its
identity is its content's hash as for a local file: a changed object is refused on resume, from any machine.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qbatch.errors import InputError
from qbatch.inputs.readers import FOLDER_SUFFIXES, stable_path
from qbatch.inputs.spool import spooled_for_dry_run
from qbatch.log import log
from qbatch.spec import JobSpec
from qbatch.storage.stage import REMOTE_INPUTS
from qbatch.storage.store import ObjectInfo, Store
from qbatch.storage.urls import Url, is_remote

OUTPUT_MARK = "manifest.json"  # an object-store folder that holds one is a qbatch output folder: no inputs


def has_remote(inputs: list[str]) -> bool:
    return any(is_remote(item) for item in inputs)


def spool_remote(spec: JobSpec, folder: Path) -> tuple[JobSpec, dict[str, str]]:
    """A spec whose remote inputs are replaced by their copies under `folder`/inputs/remote/, and the URL
    of each copy (by its path, as the run names it)."""
    if not has_remote(spec.input.inputs):
        return spec, {}
    inputs: list[str] = []
    names: dict[str, str] = {}
    stores: dict[tuple[str, str], Store] = {}
    for item in spec.input.inputs:
        if not is_remote(item):
            inputs.append(item)
            continue
        url = Url.parse(item)
        store = stores.get((url.scheme, url.bucket)) or stores.setdefault((url.scheme, url.bucket), Store(url))
        for found in expand_remote(store, url):
            copy = folder / REMOTE_INPUTS / found.url.scheme / found.url.path
            _fetch(store, found, copy)
            inputs.append(str(copy))
            names[str(stable_path(copy))] = str(found.url)
    return dataclasses.replace(spec, input=dataclasses.replace(spec.input, inputs=inputs)), names


@contextmanager
def copied_for_dry_run(spec: JobSpec) -> Iterator[tuple[JobSpec, dict[str, str]]]:
    """The spec with its streams and remote objects copied to a temporary folder (removed afterwards), and
    the copies' URLs (spool_remote)."""
    with spooled_for_dry_run(spec) as spooled:
        if not has_remote(spooled.input.inputs):
            yield spooled, {}
            return
        with tempfile.TemporaryDirectory(prefix="qbatch-remote-") as folder:
            yield spool_remote(spooled, Path(folder))


def expand_remote(store: Store, url: Url) -> list[ObjectInfo]:
    """The objects `url` names: the object, a folder's objects of FOLDER_SUFFIXES (not those of qbatch output
    folders), or a glob's matches (`*` within a name, `**` across folders), sorted."""
    if url.is_glob:
        base = Url(url.scheme, url.path[:min(url.path.find(c) for c in "*?[" if c in url.path)].rpartition("/")[0])
        pattern = url.path.replace("**/", "\0").replace("**", "\0")
        found = [o for o in _not_output(store.walk(base)) if _matches(o.url.path, pattern)]
        if not found:
            raise InputError("no objects match the pattern", where=str(url), hint="check the pattern and the bucket")
        return found
    single = store.info(url) if url.key else None
    if single is not None:
        return [single]
    found = [o for o in _not_output(store.walk(url)) if o.url.name.endswith(FOLDER_SUFFIXES)]
    if not found:
        raise InputError("no such object, nor a folder of .jsonl/.ndjson/.parquet objects", where=str(url),
                         hint="check the URL; quote globs so that the shell leaves them")
    return found


def _matches(path: str, pattern: str) -> bool:
    """fnmatch where `*` stays within a name and `\\0` (what `**` was) crosses folders."""
    if "\0" in pattern:
        head, _, tail = pattern.partition("\0")
        return path.startswith(head) and any(_matches(rest, tail) for rest in _suffixes(path[len(head):]))
    return len(path.split("/")) == len(pattern.split("/")) and fnmatch.fnmatchcase(path, pattern)


def _suffixes(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[i:]) for i in range(len(parts))]


def _not_output(objects: list[ObjectInfo]) -> list[ObjectInfo]:
    outputs = {o.url.path.rpartition("/")[0] for o in objects if o.url.name == OUTPUT_MARK}
    return [o for o in objects if not any(o.url.path.startswith(folder + "/") for folder in outputs)]


def _fetch(store: Store, found: ObjectInfo, copy: Path) -> None:
    """Download `found` into `copy` unless the copy there is of the same version (ETag and size)."""
    mark = copy.with_name(copy.name + ".etag")
    version = json.dumps({"etag": found.etag, "size": found.size})
    if found.etag and copy.is_file() and mark.is_file() and mark.read_text() == version:
        return
    log.info(f"copying {found.url} ({found.size:,} bytes)")
    store.download(found.url, copy)
    mark.write_text(version)
