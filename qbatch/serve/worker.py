"""The queue's runner: one thread taking batches oldest first and running each through `Session.run`.

Each batch runs in its own folder (DATA_DIR/batches/<id>/out) with qbatch's parts, so a batch
the service was killed in resumes by row id on the next start, as `qbatch run` does. A cancel,
the end of the completion window and a shutdown stop the run within about a second (they set the
run's stop request; the rows finished by then are written); the engines stay warm. Whatever one
batch does, the thread goes on with the next.

Every request of a batch that ends ends in its output file or its error file: one the run did not
reach gets `batch_cancelled`, `batch_expired` or `batch_failed`, and `request_counts` adds up to
the total. Texts in the error file and in `errors` are for API clients (`client_text`); a failure's
details go to the service's log.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from qbatch._fs import atomic_write
from qbatch.engines.pool import EnginePool
from qbatch.errors import QbatchError, Stopped, first_line
from qbatch.inputs.validate import EMBEDDINGS_URL
from qbatch.jobs.events import StopRequest
from qbatch.log import log
from qbatch.output.assemble import assemble, flag_counts, json_line, write_openai_jsonl
from qbatch.output.folder import OutputDir
from qbatch.output.manifest import Manifest
from qbatch.output.flags import flag_lines
from qbatch.serve.config import ServeSettings
from qbatch.serve.objects import TERMINAL, Batch, BatchStatus, StoredFile, client_text, new_file_id, now, usage
from qbatch.serve.requests import custom_ids
from qbatch.serve.store import Store
from qbatch.session import Session
from qbatch.session.session import ENGINE_LOG

IDLE_POLL_S = 1.0  # how often an idle worker looks at the queue's completion windows
# How every batch's input is read: OpenAI batch lines, keyed by custom_id alone (a line's other keys,
# an `id` too, are ignored, as OpenAI does); the upload check (requests.py) holds them to that.
BATCH_INPUT = {"format": "jsonl", "shape": "openai"}
# What a request the run did not reach gets in the error file, by how its batch ended.
NOT_RUN = {
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled first."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "failed": ("batch_failed", "This request was not executed: the batch failed first."),
}


class BatchWorker(threading.Thread):
    def __init__(self, store: Store, settings: ServeSettings, pool: EnginePool):
        super().__init__(name="qbatch-serve-worker", daemon=True)
        self.store = store
        self.settings = settings
        # the service's engines (it closes them); vLLM's output to the data folder's engine log
        self.session = Session(**settings.engine, engine_log=settings.data_dir / ENGINE_LOG, pool=pool)
        self.session.sets_log_level = False  # the service's lines show while batches run
        self.ready = threading.Event()  # the engines are warm
        self.failed: str | None = None  # why the engines could not start
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._claim = threading.Lock()  # held while a batch is chosen, and while a cancel finishes a waiting one
        self._current: str | None = None
        self._stop_current = StopRequest()  # the running batch's: reason cancel, expire or shutdown
        self._client_stops: set[StopRequest] = set()  # the jobs handed over by clients (runs.py), running or waiting

    # -- called from the HTTP threads ---------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Stop within about a second; the running batch stays queued and resumes on the next start."""
        self._stopping.set()
        self._stop_current.request("shutdown")
        for stop in list(self._client_stops):
            stop.request("shutdown")
        self._wake.set()

    @contextlib.contextmanager
    def client_run(self, stop: StopRequest) -> Iterator[None]:
        """A client's job (runs.py) runs in this block: a shutdown stops it as it stops the batch running."""
        self._client_stops.add(stop)
        try:
            if self._stopping.is_set():
                stop.request("shutdown")
            yield
        finally:
            self._client_stops.discard(stop)

    def cancel(self, batch_id: str) -> Batch | None:
        """`cancelling`, then `cancelled` at once for a waiting batch, within about a second for the running
        one; a batch already on its way to the end is returned as it is; None: the batch had ended."""
        with self._claim:
            batch = self._stored(batch_id)
            if batch.status in TERMINAL:
                return None
            if batch.status not in ("validating", "in_progress"):
                return batch
            batch = self._change(batch_id, "cancelling")
            if self._current == batch_id:
                self._stop_current.request("cancel")
                return batch
            return self._finalize(batch, "cancelled")

    # -- the thread -----------------------------------------------------------
    def run(self) -> None:
        try:
            self._warm_up()
        except BaseException as exc:  # noqa: BLE001 - the service reports it on /health and keeps answering
            self.failed = first_line(exc)
            log.error(f"serve: the engines did not start: {self.failed}")
            return
        self.ready.set()
        while not self._stopping.is_set():
            batch = self._next()
            if batch is None:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
                continue
            try:
                self._process(batch)
            except BaseException as exc:  # noqa: BLE001 - one batch never stops the queue
                log.exception(f"serve: batch {batch.id} failed: {first_line(exc)}")
                self._fail(batch.id, "internal_error", "an internal error stopped the batch")
            finally:
                self._current = None
        self.session.close()

    def _warm_up(self) -> None:
        """Start the engines now (the first batch would wait for them otherwise) with a 1-token run."""
        self._session_run(["warm up"], max_tokens=1, progress="none")
        log.info(f"serve: engines ready (model {self.settings.model})")

    def _session_run(self, data: Any, *, embed: bool = False, **settings: Any) -> None:
        """`Session.run` (`embed`: Session.embed_result, `qbatch embed`'s job)."""
        (self.session.embed_result if embed else self.session.run)(data, **settings)

    def _next(self) -> Batch | None:
        with self._claim:
            for batch in self.store.pending():
                if batch.status == "in_progress" and now() >= batch.expires_at:
                    self._finalize(batch, "expired")
                    continue
                self._current = batch.id
                self._stop_current = StopRequest()
                if self._stopping.is_set():
                    self._stop_current.request("shutdown")
                return batch
        return None

    def _process(self, batch: Batch) -> None:
        if batch.status == "cancelling":
            self._finalize(batch, "cancelled")
        elif batch.status == "finalizing":
            self._finalize(batch, "completed")
        else:
            self._run(batch)

    def _run(self, batch: Batch) -> None:
        batch_id = batch.id
        source = self.store.file(batch.input_file_id)
        if source is None:
            self._fail(batch_id, "input_file_missing", f"input file {batch.input_file_id} was deleted")
            return
        folder = self._folder(batch_id) / "out"
        before = OutputDir(folder)
        done_ok, done_failed = len(before.result_ids()), len(before.error_ids())
        log.info(f"serve: batch {batch_id} running ({batch.request_counts.total} requests, "
                 f"{done_ok + done_failed} done before)")

        stop = self._stop_current

        def on_progress(rows_done: int, rows_failed: int) -> None:
            counts = replace(batch.request_counts, completed=done_ok + rows_done - rows_failed,
                             failed=done_failed + rows_failed)
            self.store.update_batch(batch_id, lambda b: b.changed(request_counts=counts))
            if now() >= batch.expires_at:
                stop.request("expire")

        try:
            # /v1/embeddings batches: the service's model as an embedding model, on an engine of its own
            # started by the first such batch (on a GPU, leave it room: --gpu-memory-utilization)
            self._session_run(source.path, embed=batch.endpoint == EMBEDDINGS_URL, output_dir=folder,
                              on_progress=on_progress, stop_request=stop,
                              **{"progress": "log", **self.settings.job, **BATCH_INPUT})
        except Stopped as stopped:
            if stopped.reason == "shutdown":
                log.info(f"serve: batch {batch_id} stopped by the shutdown; it resumes on the next start")
            else:
                self._finalize(self._stored(batch_id), "cancelled" if stopped.reason == "cancel" else "expired")
            return
        except QbatchError as exc:
            log.error(f"serve: batch {batch_id} failed: {exc}" + (f"; {exc.hint}" if exc.hint else ""))
            self._fail(batch_id, "run_failed", f"the batch could not run ({type(exc).__name__})")
            return
        self._finalize(self._change(batch_id, "finalizing"), "completed")  # a stop after the last part: all is done

    # -- state changes -------------------------------------------------------
    def _folder(self, batch_id: str) -> Path:
        return self.settings.data_dir / "batches" / batch_id

    def _stored(self, batch_id: str) -> Batch:
        batch = self.store.batch(batch_id)
        if batch is None:  # batches are never deleted
            raise LookupError(f"no batch {batch_id} in the store")
        return batch

    def _change(self, batch_id: str, status: BatchStatus, **changes: Any) -> Batch:
        batch = self.store.update_batch(batch_id, lambda b: b.changed(status, **changes))
        log.info(f"serve: batch {batch_id} {status}")
        return batch

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        """The batch fails with `message` (for API clients: the service's log has the details); what its run
        finished is handed out, and its other requests get `batch_failed`."""
        message = f"{message}; the service's log says why (batch {batch_id})"
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]}
        try:
            self._finalize(self._stored(batch_id), "failed", errors=errors)
        except Exception:  # noqa: BLE001 - its parts cannot be read: the batch fails without files
            log.exception(f"serve: batch {batch_id}: its results could not be written")
            self._change(batch_id, "failed", errors=errors)

    def _finalize(self, batch: Batch, status: BatchStatus, **changes: Any) -> Batch:
        """Write the output and error files from the batch's folder, hand them out with the final status,
        the counts and the usage (one transaction)."""
        batch_id = batch.id
        ended = self._stored(batch_id)
        if ended.status in TERMINAL:  # its files are handed out: never rewritten, its status never changed
            log.warning(f"serve: batch {batch_id} has ended ({ended.status}); it stays so, not {status}")
            return ended
        folder = self._folder(batch_id)
        out = folder / "out"
        folder.mkdir(parents=True, exist_ok=True)
        manifest = Manifest.read(out / "manifest.json")
        if manifest is None or manifest.status != "completed":
            od = OutputDir(out).open()
            try:
                assemble(od)
            finally:
                od.close()
        output_path, errors_path = folder / "output.jsonl", folder / "errors.jsonl"
        write_openai_jsonl(out, self.settings.model, results_path=output_path, errors_path=errors_path)
        self._for_clients(batch, status, out, errors_path)
        files = []
        lines = {"completed": _count_lines(output_path), "failed": _count_lines(errors_path)}
        counts = replace(batch.request_counts, **lines)
        for key, path, count_key in (("output_file_id", output_path, "completed"),
                                     ("error_file_id", errors_path, "failed")):
            if lines[count_key]:
                record = StoredFile(new_file_id(), "batch_output", f"{batch_id}_{path.name}", path.stat().st_size,
                                    now(), str(path), lines[count_key])
                files.append(record)
                changes[key] = record.id
        changes.update(request_counts=counts, usage=batch_usage(out / "results.parquet"))
        # the lines stay OpenAI's (finish_reason "length"); the log says what a user must not miss (flags.py),
        # before a client can see the batch done (counted over results.parquet's rows: with n > 1 a request's
        # line holds several)
        for line in flag_lines(flag_counts(out / "results.parquet"), _num_rows(out / "results.parquet")):
            log.warning(f"serve: batch {batch_id}: {line}")
        batch = self.store.update_batch(batch_id, lambda b: b.changed(status, **changes), new_files=files)
        log.info(f"serve: batch {batch_id} {status} ({counts.completed} completed, {counts.failed} failed)")
        return batch

    def _for_clients(self, batch: Batch, status: BatchStatus, out: Path, errors_path: Path) -> None:
        """The error file as API clients get it: the run's messages in `client_text`, then a line for each
        request the run did not reach (`NOT_RUN`), in input order."""
        lines = []
        with open(errors_path, "rb") as handle:
            for raw in handle:
                if raw.strip():
                    line = json.loads(raw)
                    line["error"]["message"] = client_text(line["error"]["message"])
                    lines.append(line)
        source = self.store.file(batch.input_file_id)
        if status in NOT_RUN and source is not None:
            code, message = NOT_RUN[status]
            done = _ids(out / "results.parquet") | _ids(out / "errors.parquet")
            lines += [{"id": f"batch_req_{cid}", "custom_id": cid, "response": None,
                       "error": {"code": code, "message": message}}
                      for cid in custom_ids(source.path) if cid not in done]

        def write(tmp: Path) -> None:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.writelines(json_line(line) for line in lines)

        atomic_write(errors_path, write)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def _ids(path: Path) -> set[str]:
    """The row ids of an output folder's results.parquet or errors.parquet (the requests' custom_ids)."""
    import polars as pl

    return set(pl.read_parquet(path, columns=["id"])["id"].to_list())


def batch_usage(results: Path) -> dict[str, Any]:
    """`Batch.usage` from a run's results: a request's prompt (and its cached part) counts once, every
    sample's output counts."""
    import polars as pl

    frame = pl.scan_parquet(results)
    columns = frame.collect_schema().names()
    first_sample = pl.col("sample_index").fill_null(0) == 0 if "sample_index" in columns else pl.lit(True)

    def total(column: str, *, per_request: bool) -> pl.Expr:
        if column not in columns:
            return pl.lit(0).alias(column)
        return (pl.col(column).filter(first_sample) if per_request else pl.col(column)).sum()

    row = frame.select(total("prompt_tokens", per_request=True), total("completion_tokens", per_request=False),
                       total("cached_tokens", per_request=True)).collect().row(0)
    return usage(*(int(value or 0) for value in row))


def _num_rows(path: Path) -> int:
    """The rows of a Parquet file, from its footer."""
    import pyarrow.parquet as pq

    rows: int = pq.read_metadata(path).num_rows
    return rows
