"""When finished rows are written: gathered as they come back, then written as one part.

Rows come back from the engine as they finish (engines/base.py) and are counted at once (runner.py);
here they wait for the next part, which is written when their chunk's last row is in (at most once
every PART_MIN_S), when PART_MAX_ROWS have gathered, or when the oldest has waited part_wait_s(): a
share of the time generated so far, between PART_MIN_S and PART_MAX_S. So parts come every few
seconds in a short run and spread over any run, while a run of hours writes a few hundred, not one a
second (resume, `qbatch status` and the assembly read them all: docs/benchmarks.md). Many engines
get small chunks (plan/resolve.py splits the chunk budget among them) that end many times a second:
a part for each cost the driver a Parquet file a chunk, its main ceiling (docs/benchmarks.md, "the
coordinator's ceiling"), hence the spacing. A run that stops (Ctrl-C,
SIGTERM, a failed engine, a cancelled batch) writes what it gathered before it goes; a run killed
outright loses at most the rows of the last wait, which its resume redoes.
"""

from __future__ import annotations

import time
from typing import Any

from qbatch.log import log
from qbatch.output.columns import ColumnTypes
from qbatch.output.embeddings import embeddings_table
from qbatch.output.folder import ERROR_PREFIX, RESULT_PREFIX, OutputDir
from qbatch.output.tables import failures_table, results_table
from qbatch.records import Failure
from qbatch.spec import EmbedSpec

PART_MIN_S = 2.0
PART_MAX_S = 60.0
PART_SHARE = 0.02  # of the generation's time so far: what a kill outright may cost, at most
PART_MAX_ROWS = 10_000


def part_wait_s(generating_s: float) -> float:
    """How long a finished row may wait for its part, `generating_s` seconds into the generation."""
    return min(max(PART_SHARE * generating_s, PART_MIN_S), PART_MAX_S)


class PartWriter:
    """The run's finished rows not written yet (results, and failures), and the parts they go to.

    Writing a part returns its record for the run's summary: its rows, its failed rows, when it was
    written (seconds into the generation) and how long writing it took.
    """

    def __init__(self, out: OutputDir, sources: list[str], generating_since: float, *,
                 include_prompt: bool, embed: EmbedSpec | None = None):
        self.out, self.sources = out, sources
        self.generating_since = generating_since
        self.include_prompt, self.embed = include_prompt, embed
        self.column_types: ColumnTypes | None = None  # the results' (known once the run is open)
        self._ok: list[Any] = []  # Completions, or with `embed` Embeddings
        self._failed: list[Failure] = []
        self._since: float | None = None  # when the oldest row waiting came
        self._written_at: float | None = None  # when the last part was written

    @property
    def num_waiting(self) -> int:
        return len(self._ok) + len(self._failed)

    def add(self, ok: list[Any], failed: list[Failure]) -> None:
        if self._since is None and (ok or failed):
            self._since = time.monotonic()
        self._ok += ok
        self._failed += failed

    def due(self, *, chunk_done: bool = False) -> bool:
        """Whether the rows waiting are to be written now (`chunk_done`: the last rows came in were their chunk's
        last, which makes a part unless one was written less than PART_MIN_S ago)."""
        if self._since is None:
            return False
        now = time.monotonic()
        spaced = self._written_at is None or now - self._written_at >= PART_MIN_S
        return ((chunk_done and spaced) or self.num_waiting >= PART_MAX_ROWS
                or now - self._since >= part_wait_s(now - self.generating_since))

    def write(self) -> dict[str, Any] | None:
        """Write the rows waiting: the results as one part, the failures as one errors part; the part's
        record (None: nothing was waiting). They are taken first, so a stop that comes during the write
        never writes them twice (it redoes them)."""
        ok, failed, self._ok, self._failed, self._since = self._ok, self._failed, [], [], None
        if not ok and not failed:
            return None
        started = time.monotonic()
        if ok and self.embed is not None:
            self.out.write_part(RESULT_PREFIX, embeddings_table(ok, self.sources, self.embed,
                                                                include_prompt=self.include_prompt,
                                                                column_types=self.column_types))
        elif ok:
            self.out.write_part(RESULT_PREFIX, results_table(ok, self.sources, include_prompt=self.include_prompt,
                                                             column_types=self.column_types))
        if failed:
            self.out.write_part(ERROR_PREFIX, failures_table(failed))
        written = self._written_at = time.monotonic()
        return {"rows": len(ok), "failed": len(failed), "written_s": round(written - self.generating_since, 3),
                "write_s": round(written - started, 4)}

    def write_on_stop(self) -> dict[str, Any] | None:
        """Write the rows waiting as the run stops (a signal, a failure); a failure to write (its cause may
        be why the run stops) leaves them to the resume."""
        try:
            return self.write()
        except Exception as exc:
            log.warning("the rows finished since the last part were not written (a resume redoes them): %s", exc)
            return None
