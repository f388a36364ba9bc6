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
