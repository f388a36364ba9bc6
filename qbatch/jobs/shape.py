"""A job's shape before it generates, and the engines it gets from it.

The shape (rows; prompt and output tokens) comes from the first SAMPLE_ROWS rows to process,
rendered and tokenized as the run will (the tokenizer loads here, once, instead of beside the
engines' start), and the inputs' sizes. It is taken before any engine starts: engines per GPU
and torch.compile are fixed when an engine starts, and engines sharing a GPU start right after
the output folder's checks (runner.py) to load beside the tokenizer and the id pre-scan. So the
choice costs the engines the tokenizer's load of head start (seconds, against 20-60 s of
engine start), and only in jobs where it can change something: on a GPU, with the vLLM
backend, when the user set neither --engines-per-gpu, --compilation-mode, --enforce-eager nor
a compilation_config in QBATCH_VLLM_ARGS (an explicit setting always wins).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

from qbatch.engines import compile_cache
from qbatch.engines.placement import TORCH_COMPILE, EngineChoice, choose_engines, gpu_ids, gpu_memory_bytes
from qbatch.engines.pool import EnginePool
from qbatch.engines.vllm import EXTRA_ARGS_ENV  # a compilation_config there is the user's choice
from qbatch.inputs.readers import detect_format
from qbatch.jobs.job import Job, place_engines
from qbatch.log import log
from qbatch.spec import JobSpec, parse_shard

SAMPLE_ROWS = 512


@dataclass(frozen=True)
class JobShape:
    """Rows to process and their tokens (output: max_tokens x n, the most they may generate)."""

    rows: int
    prompt_tokens: int
    output_tokens: int
    estimated: bool  # from a sample and the inputs' sizes (else every row was sampled)


def choose_for_shape(job: Job, done: set[str], pool: EnginePool) -> tuple[Job, EngineChoice | None]:
    """The job with the engines its shape calls for (a new Job; its spec a new spec), and the choice;
    the job as it is and None where no choice is made. An engine of `pool` that fits the job is chosen first."""
    if not _may_choose(job):
        return job, None
    default_engines = job.spec.engine.engines_per_gpu or 1
    compiled = [_with_choice(job, EngineChoice(n, TORCH_COMPILE, "")).spec.engine
                for n in dict.fromkeys((default_engines, 1))]  # the choices a warm and a cold cache give
    for running in (job.spec.engine, *compiled):  # a warm engine (a Session's) beats any start
        if pool.has(running, job.model_path, job.max_model_len):
            return _with_choice(job, EngineChoice(running.engines_per_gpu or 1, running.compilation_mode,
                                                  "an engine with these settings is running: reused")), None
    shape = sample_shape(job, done)
    if not shape.rows:
        return job, None
    warm = compile_cache.is_warm(compiled[0].one_engine(), job.model_path, job.max_model_len)
    choice = choose_engines(shape.prompt_tokens, shape.output_tokens, shape.rows, gpu=True, compile_cache_warm=warm,
                            default_engines=default_engines)
    estimated = f" (estimated from {SAMPLE_ROWS} rows)" if shape.estimated else ""
    log.info("engines: %s%s", choice.reason, estimated)
    return _with_choice(job, choice), choice


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


def _may_choose(job: Job) -> bool:
    engine = job.spec.engine
    if engine.backend != "vllm" or not job.auto_engines or engine.compilation_mode is not None \
            or engine.enforce_eager is not None or "compilation_config" in os.environ.get(EXTRA_ARGS_ENV, ""):
        return False
    return gpu_memory_bytes(gpu_ids(engine)[0]) is not None


def _with_choice(job: Job, choice: EngineChoice) -> Job:
    """The job with `choice`'s engines (and, unless the user set it, the chunk size that follows)."""
    spec = job.spec
    if (spec.engine.engines_per_gpu, spec.engine.compilation_mode) == (choice.engines_per_gpu,
                                                                        choice.compilation_mode):
        return job
    plan = replace(spec.plan, chunk_tokens=None) if job.auto_chunk_tokens else spec.plan
    chosen: JobSpec = replace(spec, plan=plan, engine=replace(spec.engine, compilation_mode=choice.compilation_mode))
    new = replace(job, spec=place_engines(chosen, choice.engines_per_gpu, job.weights_bytes, auto_kv=job.auto_kv))
    if "preparer" in job.__dict__:  # the tokenizer loaded for the sample; it reads no engine setting
        new.__dict__["preparer"] = job.preparer
    return new
