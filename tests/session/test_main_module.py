"""A Session in a script that multiprocessing's spawn cannot import again (read from standard input), or
should not (no `if __name__ == "__main__":`): the engine's processes start all the same.

vLLM spawns its engine core on the CPU (and once CUDA is up), qbatch its data-parallel workers; a stand-in
engine here starts a spawned child the same way, so that no model has to load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import multiprocessing, os
import qbatch
from qbatch.engines import base
from qbatch.engines.pool import EnginePool

class SpawningEngine(base.NullEngine):
    """Starts a child as vLLM's engine core is started (spawn), then generates as the null engine."""

    def __init__(self, *args, **kwargs):
        child = multiprocessing.get_context("spawn").Process(target=os.getpid)
        child.start()
        child.join(60)
        if child.exitcode != 0:
            raise RuntimeError(f"the spawned child failed (exit code {child.exitcode})")

session = qbatch.Session(MODEL, pool=EnginePool(start=SpawningEngine))
print("ANSWER", session.generate(["hi"], max_tokens=2, progress="none"))
session.close()
'''


@pytest.mark.parametrize("how", ["standard input", "a file without a main guard"])
def test_a_session_starts_its_engine_from_a_script_spawn_cannot_import(bundled_model, tmp_path, how):
    code = SCRIPT.replace("MODEL", repr(bundled_model))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if how == "standard input":
        proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
    else:
        (tmp_path / "script.py").write_text(code)
        proc = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ANSWER") == 1  # the child did not run the script again
    assert "Error" not in proc.stderr
