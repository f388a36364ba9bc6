"""results.parquet written a range of input rows at a time: the assembly's memory does not grow with the job.

polars sorts a whole frame in memory, even in its streaming engine: a million 1,024-dim embeddings
(4 GB) took 6.2 GB of RSS to assemble, and a million short answers 500 MB (docs/benchmarks.md,
"Embeddings" and "memory per row"). Every part holds the rows of one chunk, and a chunk is cut from
one window of consecutive input rows, so the rows of a range of input positions lie in a few
parts: the parts' row spans are read once from their footers, and each range reads only the parts
that overlap it, is de-duplicated, sorted and appended to the file; memory holds one range at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from qbatch.output.reading import PART_HINT, reading

# Rows of one range: 32,768 vectors of 1,024 float32 are 128 MB.
RANGE_ROWS = 32_768


@dataclass(frozen=True)
class PartSpan:
    """The input rows a part holds, from its footer; source_index None: unknown (read for every range)."""

    path: Path
    source_index: int | None
    first: int = 0
    last: int = -1

    def overlaps(self, source_index: int, low: int, high: int) -> bool:
        return self.source_index is None or (self.source_index == source_index and self.first < high
                                             and self.last >= low)


def part_span(path: Path) -> PartSpan:
    """Its rows' source and row_index bounds (its Parquet statistics), unknown when it holds several sources."""
    import pyarrow.parquet as pq

    with reading(path, PART_HINT):
        meta = pq.ParquetFile(path).metadata
    bounds: dict[str, list[int]] = {"source_index": [], "row_index": []}
    for group in range(meta.num_row_groups):
        for column in range(meta.num_columns):
            chunk = meta.row_group(group).column(column)
            name, stats = chunk.path_in_schema, chunk.statistics
            if name in bounds and meta.row_group(group).num_rows:
                if stats is None or not stats.has_min_max:
                    return PartSpan(path, None)
                bounds[name] += [stats.min, stats.max]
    sources, rows = bounds["source_index"], bounds["row_index"]
    if not rows:
        return PartSpan(path, None) if meta.num_rows else PartSpan(path, -1)
    if not sources or min(sources) != max(sources):
        return PartSpan(path, None)
    return PartSpan(path, sources[0], min(rows), max(rows))


def sink_by_ranges(paths: list[Path], frame_of: Callable[[list[Path]], pl.LazyFrame], path: Path, *,
                   range_rows: int = RANGE_ROWS,
                   conform: Callable[[pl.LazyFrame], pl.LazyFrame] | None = None) -> None:
    """Write the rows of the parts at `paths` (`frame_of` reads some of them as one frame, keyed by
    source_index, row_index, and with n > 1 sample_index; a redone chunk's copies kept once, the first
    part's) to `path` in input order, without source_index, one range of rows at a time. `conform`
    gives all the parts' frame its columns (their order, those no part has), once: each range takes them.
    A part whose footer cannot be read is an OutputError naming it, before anything is written."""
    import pyarrow.parquet as pq

    spans = [part_span(p) for p in paths]
    whole = frame_of(paths)
    columns = (whole if conform is None else conform(whole)).collect_schema()
    key, order = (["id", "sample_index"], ["row_index", "sample_index"]) if "sample_index" in columns else (["id"], ["row_index"])
    writer: Any = None
    try:
        for source_index, last in _last_rows(spans, frame_of).items():
            for low in range(0, last + 1, range_rows):
                chosen = [s.path for s in spans if s.overlaps(source_index, low, low + range_rows)]
                if not chosen:
                    continue
                frame = (_with_columns(frame_of(chosen), columns)
                         .filter((pl.col("source_index") == source_index) & (pl.col("row_index") >= low)
                                 & (pl.col("row_index") < low + range_rows)))
                if "sample_index" in columns:
                    frame = frame.with_columns(pl.col("sample_index").fill_null(0))
                table = frame.filter(pl.struct(key).is_first_distinct()).sort(order).drop("source_index").collect().to_arrow()
                if writer is None:
                    writer = pq.ParquetWriter(path, table.schema, compression="zstd")
                writer.write_table(table.cast(writer.schema))
        if writer is None:  # no rows: the empty frame's columns
            frame_of(paths).drop("source_index").head(0).sink_parquet(path, compression="zstd")
    finally:
        if writer is not None:
            writer.close()


def _last_rows(spans: list[PartSpan], frame_of: Callable[[list[Path]], pl.LazyFrame]) -> dict[int, int]:
    """Each source's last row_index among the parts, in source order (read from the rows where a footer does not say)."""
    unknown = [s.path for s in spans if s.source_index is None]
    last: dict[int, int] = {}
    for span in spans:
        if span.source_index is not None and span.source_index >= 0:
            last[span.source_index] = max(last.get(span.source_index, -1), span.last)
    if unknown:
        bounds = frame_of(unknown).group_by("source_index").agg(pl.col("row_index").max()).collect()
        for source_index, row_index in bounds.iter_rows():
            if source_index is not None:
                last[source_index] = max(last.get(source_index, -1), row_index)
    return dict(sorted(last.items()))


def _with_columns(frame: pl.LazyFrame, columns: pl.Schema) -> pl.LazyFrame:
    """`frame` in every part's columns (a column these parts lack: null), so that each range has one schema."""
    present = frame.collect_schema().names()
    return frame.select([pl.col(name) if name in present else pl.lit(None, dtype=kind).alias(name)
                         for name, kind in columns.items()])
