"""Progress: a tqdm bar on a terminal, plain periodic log lines in cron and Airflow, the caller's own
bar (a notebook's) and its on_progress (events.py).

Lines go through qbatch's logger (qbatch/log.py), which writes them through tqdm while a bar
shows; the logger's level (set by the CLI or the Session from --progress) decides what shows.

The bar appears when the generation starts (start_clock), not when the run opens: its elapsed time,
rate and ETA are then the rows' own, and the engine's start before it shows as a line of its own
(a bar drawn during a 40 s start read "4/40 [00:42<06:21, 10.59s/row]" for a job 2 s from its end).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from qbatch.jobs.events import RunEvents
from qbatch.log import log

LOG_EVERY_S = 30.0
# A caller's on_progress runs about this often as rows finish (and once all are done): `qbatch serve`
# writes the counts to its database each time.
ON_PROGRESS_S = 1.0


class Progress:
    # The tokens whose rate shows: generated ones, or for an embedding job (nothing generated) its inputs.
    tokens_of = "output"

    def __init__(self, mode: str, total: int, events: RunEvents | None = None):
        events = events or RunEvents()
        stream = events.stream or sys.stderr
        self._bar: Any = None  # tqdm's, or the caller's own
        self._new_bar = events.bar  # the caller draws its own (a notebook's)
        if mode in ("auto", "bar") and events.bar is not None:
            mode = "bar"
        elif mode == "auto":
            mode = "bar" if stream.isatty() else "log"
        self.mode, self.total, self.stream = mode, total, stream
        self.done = self.failed = self.tokens = 0
        self.started = time.monotonic()
        self._last_log = self.started
        self._on_progress = events.on_progress
        self._reported = 0.0

    def start_clock(self, at: float | None = None) -> float:
        """Rates count from here, or from `at` (generation start), not from before the engine loaded;
        the bar shows from now, its clock started at `at`."""
        self.started = self._last_log = time.monotonic() if at is None else at
        if self.mode == "bar" and self._bar is None:
            self._bar = self._open_bar()
            if hasattr(self._bar, "start_t"):  # tqdm's clock is time.time(), ours monotonic
                self._bar.start_t = self._bar.last_print_t = time.time() - (time.monotonic() - self.started)
        return self.started

    def _open_bar(self) -> Any:
        if self._new_bar is not None:
            return self._new_bar(self.total)
        from tqdm import tqdm

        return tqdm(total=self.total, unit="row", file=self.stream, dynamic_ncols=True, smoothing=0.1)

    def update(self, rows: int, failed: int = 0, tokens: int = 0) -> None:
        """`rows` more done (`failed` of them failed), with `tokens` more of the rate's kind (tokens_of)."""
        self.done += rows
        self.failed += failed
        self.tokens += tokens
        rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
        if self.mode == "bar" and self._bar is None:  # rows before the generation's start: the bar shows now
            self.start_clock(self.started)
        if self._bar is not None:
            short = "out" if self.tokens_of == "output" else "in"
            self._bar.set_postfix_str(f"{rate:,.0f} {short} tok/s, {self.failed} failed", refresh=False)
            self._bar.update(rows)
        elif self.mode == "log" and (time.monotonic() - self._last_log >= LOG_EVERY_S or self.done >= self.total):
            self._last_log = time.monotonic()
            self.log(f"{self.done}/{self.total} rows ({self.failed} failed), {rate:,.0f} {self.tokens_of} tok/s")
        if self._on_progress is not None and (time.monotonic() - self._reported >= ON_PROGRESS_S
                                              or self.done >= self.total):
            self._reported = time.monotonic()
            self._on_progress(self.done, self.failed)

    def log(self, message: str) -> None:
        if self.mode != "none":
            log.info(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
