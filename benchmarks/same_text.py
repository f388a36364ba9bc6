"""How far each run's answers agree with a reference run's, row by row (issue #57's check of a lever).

    python benchmarks/same_text.py ROOT REFERENCE

ROOT holds one `qbatch bench --work-dir ROOT/NAME` folder per run; each folder's results.parquet (the
first one found) is read and compared by row id with REFERENCE's: the share of rows whose text is the
same, and the mean share of the reference text that the row repeats before its first difference. A
lever that leaves the numerics alone repeats every greedy row; bf16 kernels that add in another order
agree for a while and then part on a near tie, so the second share says how soon.
"""

from __future__ import annotations

import sys
from os.path import commonprefix
from pathlib import Path

import polars as pl


def texts(folder: Path) -> dict[str, str]:
    """Row id -> text of the run kept in `folder`."""
    found = sorted(folder.rglob("results.parquet"))
    if not found:
        return {}
    frame = pl.read_parquet(found[0], columns=["id", "text"])
    return dict(zip(frame["id"].cast(pl.String), frame["text"].fill_null("")))


def agreement(reference: dict[str, str], other: dict[str, str]) -> tuple[int, float, float]:
    """Rows compared, share of equal texts, mean share of the reference's text repeated before a difference."""
    ids = [i for i in reference if i in other]
    if not ids:
        return 0, 0.0, 0.0
    equal = sum(reference[i] == other[i] for i in ids)
    prefix = sum(len(commonprefix([reference[i], other[i]])) / max(len(reference[i]), 1) for i in ids)
    return len(ids), equal / len(ids), prefix / len(ids)


def main(root: str, name: str) -> None:
    reference = texts(Path(root) / name)
    print(f"{'run':<12} {'rows':>6} {'equal':>7} {'prefix':>7} {'empty':>6}")
    print(f"{name:<12} {len(reference):>6} {'':>7} {'':>7} {sum(not t for t in reference.values()):>6}")
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name != name):
        other = texts(folder)
        rows, equal, prefix = agreement(reference, other)
        print(f"{folder.name:<12} {rows:>6} {equal:>7.3f} {prefix:>7.3f} {sum(not t for t in other.values()):>6}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
