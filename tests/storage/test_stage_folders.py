"""Stage folders of dead processes (storage/scratch.py): a SIGKILLed process's local copy of an output folder
is removed by the next process that stages; a live process's, another host's and one without an owner stay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from qbatch.storage.scratch import COPY, OWNER_FILE, Owner, remove_dead_stages
from qbatch.storage.stage import StagedFolder
from qbatch.storage.urls import Url

ROOT = Path(__file__).resolve().parents[2]
STAGE_AND_WAIT = """
import sys, time
from qbatch.storage.stage import StagedFolder
from qbatch.storage.urls import Url
folder = StagedFolder(Url.parse(sys.argv[1]), locked=False).open()
(folder.path / "parts").mkdir()
(folder.path / "parts" / "part-000001.parquet").write_bytes(b"rows")
print(folder.root, flush=True)
time.sleep(600)
"""


def _staging_process(url: str, tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen([sys.executable, "-c", STAGE_AND_WAIT, url], cwd=ROOT, text=True,
                               env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_the_next_stage_removes_a_killed_process_stage_and_keeps_a_live_one(bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = f"s3://{bucket}/out"
    killed, killed_stage = _staging_process(url, tmp_path)
    live, live_stage = _staging_process(url, tmp_path)
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        assert (killed_stage / COPY / "parts" / "part-000001.parquet").is_file()  # what SIGKILL leaves
        other_host = tmp_path / "qbatch-stage-other-host"
        other_host.mkdir()
        (other_host / OWNER_FILE).write_text(json.dumps({**asdict(Owner.me()), "host": "another-machine", "pid": killed.pid}))
        unowned = tmp_path / "qbatch-stage-being-made"
        unowned.mkdir()

        folder = StagedFolder(Url.parse(url), locked=False).open()  # the next process that stages
        try:
            assert not killed_stage.exists()
            assert live_stage.is_dir() and other_host.is_dir() and unowned.is_dir()
            assert Owner.read(folder.root) == Owner.me()
        finally:
            folder.discard()
        assert not folder.root.exists()
    finally:
        live.kill()
        live.wait()
    assert remove_dead_stages(tmp_path) == [live_stage]  # dead now too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qbatch-stage-being-made", "qbatch-stage-other-host"]


def test_an_owner_whose_pid_now_names_another_process_is_dead():
    me = Owner.me()
    assert not me.dead()
    if me.started is not None:  # Linux: the start time tells a reused pid
        assert replace(me, started=me.started - 1).dead()
    if me.boot_id is not None:
        assert replace(me, boot_id="an-earlier-boot").dead()
    assert not replace(me, host="another-machine", boot_id="x").dead()
