"""qbatch status on a running job: current rates, a sensible ETA and GPU utilization now."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from qbatch.output.folder import OutputDir
from qbatch.output.status import read_status
from qbatch.output.telemetry import write_part


def test_status_of_a_running_job_shows_rate_and_eta(cli, tmp_path):
    out = OutputDir(tmp_path / "out").open()  # this test holds the run lock: the job is live
    try:
        (out.path / "manifest.json").write_text(json.dumps({"status": "running", "rows_total": 1000,
                                                             "spec": {"model": "m"}}))
        now = datetime.now(timezone.utc)
        rows = []
        for s in range(60):  # 10 rows/s and 2,000 output tok/s over the last minute, 600 rows done
            t = now - timedelta(seconds=59 - s)
            rows += [{"time": t, "source": "run", "device": "", "rows_done": 10 * s, "rows_total": 1000},
                     {"time": t, "source": "engine", "device": "engine 0", "generation_tokens": 2000 * s,
                      "finished_requests": 10 * s},
                     {"time": t, "source": "gpu", "device": "0", "gpu_util_pct": 87.0}]
        write_part(out.path, rows)
        info = read_status(str(out.path))
        live = info["live"]
        assert live["rows_s"] == 10.0 and live["output_tok_s"] == 2000.0
        assert live["eta_s"] == 100.0  # 1,000 rows to do, none in parts yet: 1000 / 10
        assert live["gpu_util_pct"] == {"0": 87.0}
        result = cli("status", out.path)
        assert "10.0 rows/s, 2,000.0 output tok/s (from telemetry)" in result.output
        assert "eta" in result.output and "1m 40s" in result.output
        assert "GPU 0: 87%" in result.output
        assert json.loads(cli("status", out.path, "--json").output)["live"]["eta_s"] == 100.0
    finally:
        out.close()
    assert read_status(str(out.path))["live"] is None  # no live run: no rates, no ETA


def test_status_of_a_run_in_its_start_says_the_phase_and_the_model(cli, tmp_path, write_jsonl):
    """A run whose engine is still starting: `qbatch status` names that phase and the model, not
    '? rows/s, eta unknown, model None' (issue #53.4); once generating, the rows it has to process."""
    import threading

    from qbatch.engines.base import NullEngine
    from qbatch.engines.pool import EnginePool
    from qbatch.jobs import runner
    from qbatch.spec import JobSpec

    release, starting = threading.Event(), threading.Event()

    def held_start(*args, **kwargs):
        starting.set()
        assert release.wait(60)
        return NullEngine()

    out = tmp_path / "out"
    rows = [{"id": str(i), "prompt": f"row {i}"} for i in range(12)]
    spec = JobSpec.from_flat({"inputs": [str(write_jsonl(rows))], "output_dir": str(out), "model": "smollm2-135m",
                              "backend": "null", "progress": "none", "telemetry": False})
    done = []
    thread = threading.Thread(target=lambda: done.append(runner.run(spec, EnginePool(start=held_start))))
    thread.start()
    try:
        assert starting.wait(60)
        info = read_status(str(out))
        assert info["status"] == "running" and info["model"] == "smollm2-135m"
        assert info["live"]["phase"] == "starting the engine (loading smollm2-135m)"
        shown = cli("status", out).output
        assert "starting the engine (loading smollm2-135m)" in shown and "smollm2-135m" in shown
        assert "eta" not in shown and "rows/s" not in shown  # no rate to tell while nothing generates
    finally:
        release.set()
        thread.join(60)
    assert done and done[0].status == "completed"
    assert read_status(str(out))["live"] is None


def test_the_phase_while_generating_says_the_rows_to_process(tmp_path):
    out = OutputDir(tmp_path / "out").open()
    try:
        (out.path / "manifest.json").write_text(json.dumps({"status": "running", "rows_total": 40,
                                                             "spec": {"model": "m"}}))
        out.set_phase("generating: 40 rows to process", model="m")
        assert read_status(str(out.path))["live"]["phase"] == "generating: 40 rows to process"
    finally:
        out.close()
