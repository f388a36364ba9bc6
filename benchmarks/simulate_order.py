"""Simulate vLLM's continuous batching on a workload's lengths, to compare admission orders.

Not a measurement: a model of decode, where each step advances every running row by one
token and costs STEP_S + ROW_S per running row, and rows are admitted in order as slots
free up. It showed that a short last window of qbatch's planning started its longest rows
last (docs/benchmarks.md, sixth session). Usage: python benchmarks/simulate_order.py [ROWS...]
"""

from __future__ import annotations

import sys
from collections import deque

from qbatch.jobs.chunking import FIRST_WINDOW
from qbatch.spec import PlanSpec
from qbatch.bench.workloads import sample_lengths

SLOTS, STEP_S, ROW_S = 2048, 0.008, 0.00003
SORT_WINDOW = PlanSpec().sort_window


def simulate(rows: list[tuple[int, int]]) -> float:
    """Seconds to decode (prompt, output) rows admitted in this order into SLOTS slots."""
    waiting, running, seconds = deque(rows), [], 0.0
    while waiting or running:
        while len(running) < SLOTS and waiting:
            running.append(waiting.popleft()[1])
        seconds += STEP_S + ROW_S * len(running)
        running = [left - 1 for left in running if left > 1]
    return seconds


def windows(n: int, *, merge_last: bool) -> list[int]:
    """Window sizes as the run plans them: doubling from FIRST_WINDOW; the rest joins the last or not."""
    sizes, size, left = [], FIRST_WINDOW, n
    while left > 0:
        sizes.append(min(size, left))
        left -= sizes[-1]
        size = min(2 * size, SORT_WINDOW)
        if merge_last and 0 < left < size:
            sizes[-1] += left
            left = 0
    return sizes


def longest_first(rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Most output first, then longest prompt: planning.sort_window's order."""
    return sorted(rows, key=lambda r: (r[1], r[0]), reverse=True)


def planned(rows: list[tuple[int, int]], sizes: list[int]) -> list[tuple[int, int]]:
    """Each window sorted longest first, in turn."""
    out, start = [], 0
    for size in sizes:
        out += longest_first(rows[start:start + size])
        start += size
    return out


def main(counts: list[int]) -> None:
    print("rows      input order  global sort  windows  last merged")
    for n in counts:
        rows = sample_lengths("varied", n, seed=1)
        times = (simulate(rows), simulate(longest_first(rows)),
                 simulate(planned(rows, windows(n, merge_last=False))),
                 simulate(planned(rows, windows(n, merge_last=True))))
        print(f"{n:<9} " + "  ".join(f"{t:>11.1f}" for t in times))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2500, 4096, 5000, 16384, 30000])
