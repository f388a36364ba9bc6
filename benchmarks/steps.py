"""A step-level profile of vLLM engines, read from an engine log (issue #34: where the time goes).

Run the engines with vLLM's per-iteration log on, for every engine of a bench (raw modes and qbatch's
own, which get $QBATCH_VLLM_ARGS too):

    QBATCH_VLLM_ARGS='{"disable_log_stats": false, "enable_logging_iteration_details": true}' \\
        qbatch bench prefill-mix --modes vllm-best,qbatch --json pm.json
    python benchmarks/steps.py pm.engine.log

The bench marks each timed run's start and end in the engine log; the steps between are the run's
(two engines on a GPU: both engines' steps). Per run: the steps (iterations), tokens per step, how long
the engine core waited for the GPU per step ("elapsed": the model's forward and sampling as vLLM's
engine core sees it) and per 1,000 tokens by step size, which separates kernel speed (torch.compile
or not) from feeding (how full each step is) and from time outside the steps (wall time of the run,
from the bench's JSON, minus the elapsed sum, per engine).
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass, field

ITERATION = re.compile(r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
                       r"(\d+) generation tokens, iteration elapsed time: ([\d.]+) ms(?! \(dummy\))")
MARK = re.compile(r"qbatch-bench: (start|end) (\S+) (.+)$")
SIZES = ((0, 1024), (1024, 8192), (8192, 24576), (24576, 1 << 30))


@dataclass
class Step:
    ctx_requests: int
    ctx_tokens: int
    gen_requests: int
    gen_tokens: int
    elapsed_ms: float

    @property
    def tokens(self) -> int:
        return self.ctx_tokens + self.gen_tokens


@dataclass
class Run:
    name: str
    steps: list[Step] = field(default_factory=list)


def runs(lines: list[str]) -> list[Run]:
    """The timed runs marked in an engine log, each with the engine steps logged while it ran."""
    found: list[Run] = []
    current: Run | None = None
    for line in lines:
        if mark := MARK.search(line):
            current = Run(f"{mark.group(2)} {mark.group(3)}") if mark.group(1) == "start" else None
            if current:
                found.append(current)
        elif current and (m := ITERATION.search(line)):
            current.steps.append(Step(*map(int, m.groups()[1:5]), float(m.group(6))))
    return found


def describe(run: Run) -> str:
    steps = [s for s in run.steps if s.tokens]
    if not steps:
        return "no steps"
    tokens = [s.tokens for s in steps]
    elapsed = sum(s.elapsed_ms for s in steps) / 1000
    prefill = [s for s in steps if s.ctx_tokens]
    out = [f"{len(steps)} steps ({len(prefill)} with prefill), "
           f"{sum(tokens):,} tokens ({sum(s.ctx_tokens for s in steps):,} prefill, {sum(s.gen_tokens for s in steps):,} decode)",
           f"  tokens/step mean {statistics.mean(tokens):,.0f}, median {statistics.median(tokens):,.0f}, "
           f"requests/step mean {statistics.mean(s.ctx_requests + s.gen_requests for s in steps):,.0f}",
           f"  elapsed (GPU as the engine core waits for it): {elapsed:.2f} s summed over engines, "
           f"{1000 * elapsed / len(steps):.2f} ms/step"]
    for low, high in SIZES:
        sized = [s for s in steps if low <= s.tokens < high]
        if sized:
            ms = sum(s.elapsed_ms for s in sized)
            out.append(f"  steps of {low:,}..{high:,} tokens: {len(sized)}, {sum(s.tokens for s in sized):,} tokens, "
                       f"{ms / 1000:.2f} s, {1000 * ms / sum(s.tokens for s in sized):.3f} ms per 1k tokens")
    return "\n".join(out)


def main(path: str) -> None:
    with open(path, errors="replace") as f:
        for run in runs(f.readlines()):
            print(f"{run.name}: {describe(run)}")


if __name__ == "__main__":
    main(sys.argv[1])
