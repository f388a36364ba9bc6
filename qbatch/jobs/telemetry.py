"""Telemetry: what the GPUs, this host and the engines did while a run worked, once a second.

A thread of the coordinator samples, about every SAMPLE_S seconds: each GPU through NVML
(utilization, memory, power; `nvidia-ml-py` is imported only where a GPU is present), this
process and its children (CPU %, RSS), each engine's counters (requests in it, finished
requests and their prompt, cached and generated tokens; running/waiting requests and KV-cache
usage with --enable-log-stats), and the run's own rows done. The engines keep their counters
themselves; nothing here runs per engine step.

Rows are written every FLUSH_S seconds as a part and compacted at the end (output/telemetry.py
owns the files, their columns and their bound).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from qbatch.log import carried, log
from qbatch.output.telemetry import COMPACT_PARTS, compact, part_files, write_part

SAMPLE_S = 1.0
FLUSH_S = 10.0  # a part every 10 s: what `qbatch status` and a live report see lags at most this


class Telemetry:
    """The sampling thread of one run. `engine` may be set once it exists; `progress` is read for rows
    done (an object with rows_ok, rows_failed, completion_tokens: the run's Summary)."""

    def __init__(self, output_dir: str | Path, progress: Any, rows_total: int, *, sample_s: float = SAMPLE_S,
                 flush_s: float = FLUSH_S):
        self.folder = Path(output_dir)
        self.engine: Any = None
        self._progress, self._rows_total = progress, rows_total
        self._sample_s, self._flush_s = sample_s, flush_s
        self._rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._probes = _Probes()
        self._thread = threading.Thread(target=carried(self._loop), name="qbatch-telemetry", daemon=True)

    def __enter__(self) -> Telemetry:
        self._thread.start()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(compact_parts=exc_type is None)

    def close(self, *, compact_parts: bool = True) -> None:
        """Take a last sample, write what is left and compact the parts into telemetry.parquet (not on the
        way out of an interrupted run, which must stop within its grace: the next run compacts them)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._sample()
            self._flush()
            if compact_parts:
                compact(self.folder)
        except Exception as exc:  # telemetry never fails a run: its results are what matters
            log.warning("telemetry not written: %s", exc)
        self._probes.close()

    def _loop(self) -> None:
        flushed = time.monotonic()
        while not self._stop.wait(self._sample_s):
            try:
                self._sample()
                if time.monotonic() - flushed >= self._flush_s:
                    flushed = time.monotonic()
                    self._flush()
                    if len(part_files(self.folder)) >= COMPACT_PARTS:
                        compact(self.folder)
            except Exception as exc:
                log.warning("telemetry stopped: %s", exc)
                return

    def _sample(self) -> None:
        now = datetime.now(timezone.utc)
        p = self._progress
        rows = [{"source": "run", "device": "", "rows_done": p.rows_ok + p.rows_failed,
                 "output_tokens": p.completion_tokens, "rows_total": self._rows_total}]
        rows.append({"source": "host", "device": "", **self._probes.host()})
        rows.extend({"source": "gpu", "device": index, **values} for index, values in self._probes.gpus())
        telemetry = getattr(self.engine, "telemetry", None)
        for label, sample in telemetry() if telemetry is not None else []:
            rows.append({"source": "engine", "device": label, "requests_in_engine": sample.requests_in_engine,
                         "requests_running": sample.requests_running, "requests_waiting": sample.requests_waiting,
                         "kv_cache_usage": sample.kv_cache_usage, "finished_requests": sample.finished_requests,
                         "prompt_tokens": sample.prompt_tokens, "cached_tokens": sample.cached_tokens,
                         "generation_tokens": sample.generation_tokens})
        for row in rows:
            row["time"] = now
        self._rows.extend(rows)

    def _flush(self) -> None:
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        write_part(self.folder, rows)


class _Probes:
    """This host's readings: NVML per GPU where a GPU is present, psutil for this process tree."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self._procs: dict[int, Any] = {}  # cpu_percent needs the same Process object between calls
        self._nvml, self._handles = _open_nvml()

    def host(self) -> dict[str, Any]:
        psutil = self._psutil
        try:
            family = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            family = [self._me]
        cpu, rss, seen = 0.0, 0, {}
        for proc in family:
            proc = self._procs.get(proc.pid, proc)
            try:
                with proc.oneshot():
                    cpu += proc.cpu_percent(None)
                    rss += proc.memory_info().rss
                seen[proc.pid] = proc
            except psutil.Error:
                continue
        self._procs = seen
        return {"cpu_pct": round(cpu, 1), "rss_bytes": rss}

    def gpus(self) -> list[tuple[str, dict[str, Any]]]:
        nvml, out = self._nvml, []
        for index, handle in self._handles:
            values: dict[str, Any] = {}
            try:
                values["gpu_util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                values["gpu_mem_used_bytes"], values["gpu_mem_total_bytes"] = int(memory.used), int(memory.total)
                values["gpu_power_w"] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            except Exception:  # a reading this GPU does not support stays null
                pass
            out.append((index, values))
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass


def _open_nvml() -> tuple[Any, list[tuple[str, Any]]]:
    """NVML and the GPUs this process may use (CUDA_VISIBLE_DEVICES, when it lists indices); none on CPU."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")):
        return None, []
    try:
        import pynvml
    except ImportError:
        log.warning("GPU telemetry off: nvidia-ml-py is not installed (pip install 'qbatch[gpu]')")
        return None, []
    try:
        pynvml.nvmlInit()
        indices = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception as exc:
        log.warning("GPU telemetry off: NVML did not start: %s", exc)
        return None, []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and all(part.strip().isdigit() for part in visible.split(",")):
        indices = [i for i in indices if i in {part.strip() for part in visible.split(",")}]
    return pynvml, [(i, pynvml.nvmlDeviceGetHandleByIndex(int(i))) for i in indices]
