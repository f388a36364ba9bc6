"""A job's shape before it generates, sampled so that the plan can choose its engines from it
(qbatch/plan/shape.py decides; this module samples).

The shape (rows; prompt and output tokens) comes from the first SAMPLE_ROWS rows to process,
rendered and tokenized as the run will (the tokenizer loads here, once, instead of beside the
engines' start), and the inputs' sizes. It is taken before any engine starts: engines per GPU
and torch.compile are fixed when an engine starts, and engines sharing a GPU start right after
the output folder's checks (runner.py) to load beside the tokenizer and the id pre-scan. So the
choice costs the engines the tokenizer's load of head start (seconds, against 20-60 s of
engine start), and only in jobs where it can change something (plan/shape.py's may_choose) and
whose inputs are not too small to: a JSONL input of a few MB cannot hold the tokens that repay
torch.compile (max_prompt_tokens bounds them from its size), so its engines start at once.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from qbatch.engines.pool import EnginePool
from qbatch.inputs.readers import detect_format
from qbatch.jobs.job import Job
from qbatch.log import log
from qbatch.output.done import DoneIds
from qbatch.plan.shape import (JobShape, candidates, may_choose, resolve_for_kept, resolve_for_shape,
                               resolve_for_size)
from qbatch.records import Row
from qbatch.spec import COMPRESSED_SUFFIXES, parse_shard

SAMPLE_ROWS = 512
# What a chat template may add to a row's text in tokens (role markers, a default system prompt such as
# SmolLM2's or Llama 3's dated one): generous, the bound only has to stay a bound.
ROW_TEMPLATE_TOKENS = 256
# Inputs larger than this are not counted: far from too short to compile, they sample their shape.
STOP_COUNTING_BYTES = 64 << 20


def choose_for_shape(job: Job, done: DoneIds, pool: EnginePool) -> Job:
    """The job with the engines its shape calls for (a new plan: job.plan.choice says which and why); the
    job as it is where no choice is made. An engine of `pool` that fits the job is chosen first, then the
    engines a pool kept for later runs gets (plan/shape.py's resolve_for_kept), then the shape's."""
    if not may_choose(job.plan):
        return job
    for plan in candidates(job.plan):  # a warm engine (a Session's) beats any start
        if pool.has(plan.engine):
            return job.with_plan(plan)
    kept = resolve_for_kept(job.plan) if pool.kept else None
    if kept is not None and kept.choice is not None:  # resolve_for_kept's plans have their choice
        log.info("engines: %s", kept.choice.reason)
        return job.with_plan(kept)
    bound = max_prompt_tokens(job)
    small = resolve_for_size(job.plan, bound) if bound is not None else None
    if small is not None:
        return job.with_plan(small)
    shape = sample_shape(job, done)
    plan = resolve_for_shape(job.plan, shape)
    if plan.choice is not None:
        estimated = f" (estimated from {SAMPLE_ROWS} rows)" if shape.estimated else ""
        log.info("engines: %s%s", plan.choice.reason, estimated)
    return job.with_plan(plan)


def max_prompt_tokens(job: Job) -> int | None:
    """At most how many prompt tokens the job's inputs hold, from their sizes alone: a token of the text
    is at least a byte of it, and a chat template adds at most ROW_TEMPLATE_TOKENS, the system prompt and
    an embedding instruction to a row (a row: a line). None where the size tells nothing: Parquet or
    compressed inputs, stdin, a --template (it may repeat a column), or more than STOP_COUNTING_BYTES (a
    job that large samples its shape: jobs/shape.py's note)."""
    spec = job.spec
    if spec.input.template:
        return None
    total = 0
    added = (spec.input.system_prompt or "") + (spec.embed.instruction or "")
    per_row = ROW_TEMPLATE_TOKENS + len(added.encode())
    for path, size in zip(job.files, job.input_sizes or [None] * len(job.files), strict=True):
        if detect_format(path, spec.input.format) != "jsonl" or path.name.lower().endswith(COMPRESSED_SUFFIXES) \
                or not path.is_file():
            return None
        size = path.stat().st_size if size is None else size
        if total + size > STOP_COUNTING_BYTES:
            return None
        total += size + per_row * (_lines(path, size) + 1)
    return total


def _lines(path: Path, size: int) -> int:
    """Newlines in the file's first `size` bytes."""
    count = 0
    with open(path, "rb") as f:
        while size > 0 and (block := f.read(min(size, 1 << 20))):
            count += block.count(b"\n")
            size -= len(block)
    return count


def sample_shape(job: Job, done: DoneIds) -> JobShape:
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


def _estimate_rows(job: Job, sample: list[tuple[Row, str]], done: DoneIds) -> int:
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
