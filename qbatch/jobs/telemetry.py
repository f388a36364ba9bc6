"""Telemetry: what the GPUs, this host and the engines did while a run worked, once a second.

A thread of the coordinator samples, about every SAMPLE_S seconds: each GPU through NVML
(utilization, memory, power; `nvidia-ml-py` is imported only where a GPU is present), this
process and its children (CPU %, RSS), each engine's counters (requests in it, finished
requests and their prompt, cached and generated tokens; running/waiting requests and KV-cache
usage with --enable-log-stats), and the run's own rows done. The engines keep their counters
themselves; nothing here runs per engine step.

Rows go to OUT_DIR/telemetry/part-NNNNNN.parquet every FLUSH_S seconds (atomic, like the
results' parts) and are compacted into OUT_DIR/telemetry.parquet every COMPACT_PARTS parts
and at the end. The file stays bounded: past MAX_ROWS, the samples older than KEEP_RECENT_S are
thinned to every other one, again at each compaction that finds it too big, so old hours end
up sparse and the last hour stays whole (counters are cumulative: rates over the gaps stay right).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from qbatch._fs import TMP_MARK, atomic_write
from qbatch.log import log

SAMPLE_S = 1.0
FLUSH_S = 30.0
COMPACT_PARTS = 20
MAX_ROWS = 250_000  # ~10 MB of Parquet; a day at 1 Hz with one GPU and two engines is ~350k rows
KEEP_RECENT_S = 3600.0
TELEMETRY_FILE, TELEMETRY_PARTS, PART_PREFIX = "telemetry.parquet", "telemetry", "part-"

# The columns of telemetry.parquet; one row per source per sample, null where a column does not apply.
COLUMNS: dict[str, str] = {
    "time": "timestamp",  # UTC, when the sample was taken
    "source": "str",  # run | host | gpu | engine
    "device": "str",  # gpu: its NVML index; engine: the engine's label; run/host: ""
    "rows_done": "int",  # run: rows finished this run (results and errors), as written to parts
    "output_tokens": "int",  # run: output tokens of the rows written
    "rows_total": "int",  # run: rows this run has to process
    "cpu_pct": "float",  # host: this process and its children, % of one core
    "rss_bytes": "int",  # host: resident memory of this process and its children
    "gpu_util_pct": "float",
    "gpu_mem_used_bytes": "int",
    "gpu_mem_total_bytes": "int",
    "gpu_power_w": "float",
    "requests_in_engine": "int",  # engine: requests qbatch has added and not yet got back
    "requests_running": "int",  # engine, --enable-log-stats: vLLM's scheduler stats
    "requests_waiting": "int",
    "kv_cache_usage": "float",  # 0..1
    "finished_requests": "int",  # engine counters since it started (cumulative)
    "prompt_tokens": "int",
    "cached_tokens": "int",  # prefix-cache hits among prompt_tokens
    "generation_tokens": "int",
}


def schema() -> Any:
    import pyarrow as pa

    types = {"timestamp": pa.timestamp("us", tz="UTC"), "str": pa.string(), "int": pa.int64(), "float": pa.float64()}
    return pa.schema([(name, types[kind]) for name, kind in COLUMNS.items()])


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
        self._thread = threading.Thread(target=self._loop, name="qbatch-telemetry", daemon=True)

    def __enter__(self) -> Telemetry:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Take a last sample, write what is left and compact the parts into telemetry.parquet."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._sample()
            self._flush()
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
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows, self._rows = self._rows, []
        table = pa.Table.from_pylist(rows, schema=schema())
        parts = self.folder / TELEMETRY_PARTS
        parts.mkdir(exist_ok=True)
        existing = part_files(self.folder)
        number = int(existing[-1].stem.removeprefix(PART_PREFIX)) + 1 if existing else 1
        atomic_write(parts / f"{PART_PREFIX}{number:06d}.parquet", lambda tmp: pq.write_table(table, tmp))


def part_files(folder: Path) -> list[Path]:
    parts = Path(folder) / TELEMETRY_PARTS
    if not parts.is_dir():
        return []
    return sorted(p for p in parts.iterdir() if p.name.startswith(PART_PREFIX) and p.suffix == ".parquet"
                  and TMP_MARK not in p.name)


def read(folder: str | Path) -> Any:
    """Every telemetry row of an output folder (the compacted file and the parts of a live run), by time;
    None when none was recorded."""
    import polars as pl

    folder = Path(folder)
    files = [p for p in [folder / TELEMETRY_FILE, *part_files(folder)] if p.exists()]
    if not files:
        return None
    frames = []
    for path in files:
        try:
            frames.append(pl.read_parquet(path))
        except (OSError, pl.exceptions.ComputeError):  # a part removed by a compaction meanwhile
            continue
    if not frames:
        return None
    return pl.concat(frames, how="diagonal_relaxed").unique(["time", "source", "device"]).sort("time")


def compact(folder: str | Path, *, max_rows: int = MAX_ROWS, keep_recent_s: float = KEEP_RECENT_S) -> None:
    """telemetry.parquet := itself + the parts, thinned to max_rows; then the parts go (a crash between
    the two leaves rows twice, which read() and the next compaction drop)."""
    import pyarrow.parquet as pq

    folder = Path(folder)
    parts = part_files(folder)
    if not parts:
        return
    frame = read(folder)
    if frame is None:
        return
    frame = thin(frame, max_rows=max_rows, keep_recent_s=keep_recent_s)
    table = frame.to_arrow().cast(schema())
    atomic_write(folder / TELEMETRY_FILE, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
    for part in parts:
        part.unlink(missing_ok=True)


def thin(frame: Any, *, max_rows: int, keep_recent_s: float) -> Any:
    """Halve the sample rate of everything older than keep_recent_s until the frame fits max_rows
    (then the recent part too, if it alone is over)."""
    from datetime import timedelta

    import polars as pl

    while frame.height > max_rows:
        times = frame.get_column("time").unique().sort()
        old = times.filter(times < times[-1] - timedelta(seconds=keep_recent_s))
        if old.len() < 2:
            old = times  # the recent hour alone is over the cap: thin it too
        dropped = old.gather(list(range(1, old.len(), 2)))
        before = frame.height
        frame = frame.filter(~pl.col("time").is_in(dropped.implode()))
        if frame.height == before:
            break
    return frame


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
