"""A job's shape before it generates, sampled so that the plan can choose its engines from it
(qbatch/plan/shape.py decides; this module samples).

The shape (rows; prompt and output tokens) comes from the first SAMPLE_ROWS rows to process,
rendered and tokenized as the run will (the tokenizer loads here, once, instead of beside the
engines' start), and the inputs' sizes. It is taken before any engine starts: engines per GPU
and torch.compile are fixed when an engine starts, and engines sharing a GPU start right after
the output folder's checks (runner.py) to load beside the tokenizer and the id pre-scan. So the
choice costs the engines the tokenizer's load of head start (seconds, against 20-60 s of
engine start), and only in jobs where it can change something (plan/shape.py's may_choose).
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from qbatch.engines.pool import EnginePool
from qbatch.inputs.readers import detect_format
from qbatch.jobs.job import Job
from qbatch.log import log
from qbatch.plan.shape import JobShape, candidates, may_choose, resolve_for_shape
from qbatch.spec import parse_shard

SAMPLE_ROWS = 512


def choose_for_shape(job: Job, done: set[str], pool: EnginePool) -> Job:
    """The job with the engines its shape calls for (a new plan: job.plan.choice says which and why); the
    job as it is where no choice is made. An engine of `pool` that fits the job is chosen first."""
    if not may_choose(job.plan):
        return job
    for plan in candidates(job.plan):  # a warm engine (a Session's) beats any start
        if pool.has(plan.engine):
            return job.with_plan(plan)
    shape = sample_shape(job, done)
    plan = resolve_for_shape(job.plan, shape)
    if plan.choice is not None:
        estimated = f" (estimated from {SAMPLE_ROWS} rows)" if shape.estimated else ""
        log.info("engines: %s%s", plan.choice.reason, estimated)
    return job.with_plan(plan)


def sample_shape(job: Job, done: set[str]) -> JobShape:
    """The job's shape from its first SAMPLE_ROWS rows to process (all of them in a smaller job)."""
    rows = list(islice(job.identified_rows(done), SAMPLE_ROWS))
    if not rows:
        return JobShape(0, 0, 0, estimated=False)
    preparer = job.preparer
    drafts, _ = preparer.render(rows)
    requests, _ = preparer.requests(drafts, preparer.encode(drafts))
    if not requests:
        return JobShape(0, 0, 0, estimated=False)
    prompt = sum(r.num_prompt_tokens for r in requests) / len(requests)
    output = sum(r.sampling["max_tokens"] * r.sampling.get("n", 1) for r in requests) / len(requests)
    total = len(rows) if len(rows) < SAMPLE_ROWS else _estimate_rows(job, rows, done)
    return JobShape(total, round(prompt * total), round(output * total), estimated=len(rows) >= SAMPLE_ROWS)


def _estimate_rows(job: Job, sample: list, done: set[str]) -> int:
    """Rows to process: Parquet inputs count theirs; JSONL inputs are their size over the sampled
    rows' mean size (as JSON text: an estimate, low for compressed files)."""
    spec = job.spec
    jsonl = [row for row, _ in sample if row.data is not None and not str(row.source).endswith(".parquet")]
    row_bytes = sum(len(json.dumps(row.data, default=str)) + 1 for row in jsonl) / len(jsonl) if jsonl else 0
    rows = 0
    for path in job.files:
        if detect_format(path, spec.input.format) == "parquet":
            import pyarrow.parquet as pq

            rows += pq.ParquetFile(path).metadata.num_rows
        elif row_bytes:
            rows += int(Path(path).stat().st_size / row_bytes)
    if spec.input.limit:
        rows = min(rows, spec.input.limit)
    if spec.input.shard:
        rows //= parse_shard(spec.input.shard)[1]
    return max(rows - len(done), len(sample))
