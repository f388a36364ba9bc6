"""The progress bar counts from the generation, not from the engine's start: its elapsed time, rate and
ETA are the rows' own, and the engine's start shows as a phase of its own before the bar (issue #53.3)."""

from __future__ import annotations

import re
import time

from qbatch.engines.base import NullEngine
from qbatch.engines.pool import EnginePool

START_S = 1.6  # the stand-in engine's start: over a second, so that a bar counting it shows 00:01


def slow_null_engine(*args, **kwargs) -> NullEngine:
    time.sleep(START_S)
    return NullEngine()


def test_the_bar_starts_when_the_generation_does(cli, tmp_path, write_jsonl):
    rows = [{"id": str(i), "prompt": f"row {i}"} for i in range(40)]
    result = cli("run", write_jsonl(rows), "-o", tmp_path / "out", "--model", "smollm2-135m", "--backend", "null",
                 "--progress", "bar", "--no-telemetry", pool=EnginePool(start=slow_null_engine))
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert "starting the engine (loading smollm2-135m)" in err
    bars = re.findall(r"\d+/40 \[(\d\d:\d\d)<", err)
    assert bars, err
    assert bars[-1] == "00:00", err  # the engine's 1.6 s start is not in the bar's elapsed time
    assert err.index("starting the engine") < err.index("/40 [")  # the start shows before the bar does
