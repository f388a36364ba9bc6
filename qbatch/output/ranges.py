"""results.parquet written a range of input rows at a time, for results too large to sort in memory.

polars sorts a whole frame in memory, even in its streaming engine: a million 1,024-dim embeddings
(4 GB) took 6.2 GB of RSS to assemble (docs/benchmarks.md, "Embeddings"). Every part holds the rows
of one chunk, and a chunk is cut from one window of consecutive input rows, so the rows of a range
of input positions lie in a few parts: each range is read (the parts' Parquet statistics skip the
others), de-duplicated, sorted and appended to the file, and memory holds one range at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

# Rows of one range: 32,768 vectors of 1,024 float32 are 128 MB.
RANGE_ROWS = 32_768


def sink_by_ranges(results: pl.LazyFrame, path: Path, *, range_rows: int = RANGE_ROWS) -> None:
    """Write `results` (rows keyed by source_index, row_index; a redone chunk's copies kept once, by id)
    to `path` in input order, without source_index, one range of rows at a time."""
    import pyarrow.parquet as pq

    bounds = results.group_by("source_index").agg(pl.col("row_index").max().alias("last")).sort("source_index").collect()
    writer: Any = None
    try:
        for source_index, last in bounds.iter_rows():
            for low in range(0, last + 1, range_rows):
                frame = (results.filter((pl.col("source_index") == source_index) & (pl.col("row_index") >= low)
                                        & (pl.col("row_index") < low + range_rows))
                         .filter(pl.col("id").is_first_distinct()).sort("row_index").drop("source_index").collect())
                table = frame.to_arrow()
                if writer is None:
                    writer = pq.ParquetWriter(path, table.schema, compression="zstd")
                writer.write_table(table.cast(writer.schema))
        if writer is None:  # no rows: the empty frame's columns
            results.drop("source_index").head(0).sink_parquet(path, compression="zstd")
    finally:
        if writer is not None:
            writer.close()
