"""Atomic files and folders, and the build-once lock (qbatch/_fs.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from qbatch._fs import atomic_folder, atomic_write, exclusive_lock
from qbatch.errors import OutputError


def test_atomic_folder_leaves_nothing_on_failure(tmp_path):
    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_folder(tmp_path / "model", write)
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_appears_whole(tmp_path):
    atomic_folder(tmp_path / "model", lambda folder: (folder / "config.json").write_text("{}"))
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["config.json"]


def test_atomic_write_leaves_no_temp_file_on_failure(tmp_path):
    def write(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match="cannot write a.json: the disk is full"):
        atomic_write(tmp_path / "a.json", write)
    assert list(tmp_path.iterdir()) == []


def test_exclusive_lock_makes_the_second_builder_wait(tmp_path):
    built: list[str] = []
    target = tmp_path / "built"

    def build(name: str) -> None:
        with exclusive_lock(tmp_path / ".lock"):
            if not target.exists():
                time.sleep(0.3)
                target.write_text(name)
                built.append(name)

    threads = [threading.Thread(target=build, args=(f"t{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(built) == 1


def test_atomic_write_removes_its_temp_file_whatever_stops_it(tmp_path):
    def write(tmp: Path) -> None:
        tmp.write_text("half")
        raise ValueError("a bug, not the disk")

    with pytest.raises(ValueError, match="a bug"):
        atomic_write(tmp_path / "a.json", write)
    assert list(tmp_path.iterdir()) == []
