"""A step-level profile of vLLM engines, read from an engine log (issue #34: where the time goes).

Run the engines with vLLM's per-iteration log on, for every engine of a bench (raw modes and qbatch's
own, which get $QBATCH_VLLM_ARGS too):

    QBATCH_VLLM_ARGS='{"disable_log_stats": false, "enable_logging_iteration_details": true}' \\
        qbatch bench prefill-mix --modes vllm-best,qbatch --json pm.json
    python benchmarks/steps.py pm.engine.log

The bench marks each timed run's start and end in the engine log; the steps between are the run's
(two engines on a GPU: both engines' steps). Per run: the steps (iterations), their prefill and decode
tokens, tokens per step: how full each step was, which with the run's wall time (the bench's JSON)
separates feeding (steps not full, more steps) from the speed of a step (kernels: torch.compile or
not). vLLM's "iteration elapsed time" is left out: with async scheduling it is the engine core's wait
for a batch already running, not the batch's GPU time.
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass, field

ITERATION = re.compile(r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
                       r"(\d+) generation tokens, iteration elapsed time: ([\d.]+) ms(?! \(dummy\))")
MARK = re.compile(r"qbatch-bench: (start|end) (\S+) (.+?)(?: @([\d.]+))?$")  # @: the wall clock (time.time())
SIZES = ((1, 1024), (1024, 8192), (8192, 24576), (24576, None))


@dataclass
class Step:
    ctx_requests: int
    ctx_tokens: int
    gen_requests: int
    gen_tokens: int

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
            current.steps.append(Step(*map(int, m.groups()[1:5])))
    return found


def describe(run: Run) -> str:
    steps = [s for s in run.steps if s.tokens]
    if not steps:
        return "no steps"
    tokens = [s.tokens for s in steps]
    prefill = [s for s in steps if s.ctx_tokens]
    out = [f"{len(steps)} steps ({len(prefill)} with prefill), "
           f"{sum(tokens):,} tokens ({sum(s.ctx_tokens for s in steps):,} prefill, {sum(s.gen_tokens for s in steps):,} decode)",
           f"  tokens/step mean {statistics.mean(tokens):,.0f}, median {statistics.median(tokens):,.0f}, "
           f"requests/step mean {statistics.mean(s.ctx_requests + s.gen_requests for s in steps):,.0f}"]
    for low, high in SIZES:
        sized = [s for s in steps if low <= s.tokens and (high is None or s.tokens < high)]
        if sized:
            size = f"{low:,} or more" if high is None else f"{low:,}..{high - 1:,}"
            out.append(f"  steps of {size} tokens: {len(sized)}, {sum(s.tokens for s in sized):,} tokens")
    return "\n".join(out)


def main(path: str) -> None:
    with open(path, errors="replace") as f:
        for run in runs(f.readlines()):
            print(f"{run.name}: {describe(run)}")


if __name__ == "__main__":
    main(sys.argv[1])
