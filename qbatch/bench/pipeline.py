"""The pipeline alone: `qbatch run` with the null engine vs bare batch tokenization.

The null engine returns at once, so what is timed is qbatch's own work (read,
template, tokenize, plan, write Parquet, assemble) on the same prompts that a
bare `tokenizer(list)` call encodes; peak RSS is sampled while it runs.
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any

from qbatch.bench.settings import BenchSettings, environment, qbatch_spec, work_dir
from qbatch.bench.workloads import encode_ids, render_chat, word_pool
from qbatch.engines.pool import EnginePool
from qbatch.errors import SpecError
from qbatch.output.done import DoneIds

BATCH_ROWS = 8192
DEFAULT_ROWS = 100_000


def mt_bench_like_rows(num_rows: int, pool: list[str], *, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Rows like MT-bench's: a question drawn from `pool`, numbered so no two are equal."""
    rng = random.Random(seed)
    categories = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    for i in range(num_rows):
        yield {"id": f"q{i}", "category": rng.choice(categories), "prompt": f"Question {i}: {rng.choice(pool)}"}


def prompt_pool(path: str | None, tokenizer: Any, *, seed: int = 0) -> list[str]:
    """Prompt texts from a JSONL file (`prompt` or MT-bench `turns`), or synthetic ones (~20-120 words)."""
    if path:
        pool = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                data = json.loads(line) if line.strip() else {}
                pool += [t for t in data.get("turns", [data.get("prompt")]) if isinstance(t, str) and t.strip()]
        if not pool:
            raise SpecError("no prompts found (expected `prompt` or `turns` keys)", where=path)
        return pool
    rng = random.Random(seed)
    words = word_pool(tokenizer)
    return [" ".join(rng.choices(words, k=rng.randint(20, 120))) + "?" for _ in range(500)]


def pipeline_bench(settings: BenchSettings, engines: EnginePool, *, prompts_file: str | None = None,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """qbatch's pipeline with the null engine (from `engines`) vs bare batch tokenization of the same prompts."""
    from qbatch.models import registry as models
    from qbatch.tokens import load_tokenizer
    from qbatch.jobs.job import Job
    from qbatch.jobs.runner import run

    rows = settings.rows or DEFAULT_ROWS
    with work_dir(settings.work_dir) as work:
        path = work / "pipeline.jsonl"
        spec = qbatch_spec(settings, path, work / "out-pipeline", {"backend": "null"})
        tokenizer = load_tokenizer(spec.engine.tokenizer or models.resolve(spec.engine.model))
        pool = prompt_pool(prompts_file, tokenizer, seed=settings.seed)
        with open(path, "w", encoding="utf-8") as handle:
            for row in mt_bench_like_rows(rows, pool, seed=settings.seed):
                handle.write(json.dumps(row) + "\n")
        log(f"wrote {rows:,} rows ({path.stat().st_size / 1e6:.0f} MB) from {len(pool)} prompts")

        gc.collect()
        sampler = _RssSampler()
        cpu0, started = _cpu_seconds(), time.monotonic()
        with sampler:
            summary = run(spec, engines)
        pipeline_s, cpu_s = time.monotonic() - started, _cpu_seconds() - cpu0
        log(f"pipeline: {summary.rows_ok:,} rows in {pipeline_s:.1f}s")

        job = Job.setup(spec)
        started = time.monotonic()
        job.count_todo(DoneIds())
        prescan_s = time.monotonic() - started
        stages = _stage_times(path, job.preparer.tokenizer)
    result = {
        "rows": rows, "pipeline_s": round(pipeline_s, 2), "pipeline_rows_per_s": round(rows / pipeline_s, 1),
        "pipeline_cpu_utilization": round(cpu_s / pipeline_s, 2), "cores": len(os.sched_getaffinity(0)),
        "rss_start_mb": sampler.start_mb, "rss_peak_mb": sampler.peak_mb,
        "rss_growth_mb": round(sampler.peak_mb - sampler.start_mb, 1),
        "prescan_s": round(prescan_s, 2), "prompt_tokens": summary.prompt_tokens, "num_chunks": summary.num_chunks,
        "num_parts": len(summary.parts), "part_write_s": round(sum(p["write_s"] for p in summary.parts), 2),
        **stages,
    }
    for base in ("tokenize_rendered", "tokenize_raw"):
        result[f"vs_{base}"] = round(result["pipeline_rows_per_s"] / result[f"{base}_rows_per_s"], 3)
    return {"kind": "pipeline", **environment(), "settings": {**asdict(settings), "work_dir": None,
                                                             "prompts_file": prompts_file}, "results": result}


def _stage_times(path: Path, tokenizer: Any) -> dict[str, Any]:
    """Each stage alone, in windows: JSON parsing, chat template, batch tokenization (raw and rendered)."""
    times = dict.fromkeys(("parse", "render", "tokenize_raw", "tokenize_rendered"), 0.0)
    rows = 0

    def timed(name: str, func: Callable[[], Any]) -> Any:
        started = time.monotonic()
        out = func()
        times[name] += time.monotonic() - started
        return out

    with open(path, "rb") as handle:
        while lines := list(islice(handle, BATCH_ROWS)):
            texts = timed("parse", lambda: [json.loads(line)["prompt"] for line in lines])  # noqa: B023
            rendered = timed("render", lambda: render_chat(tokenizer, texts))  # noqa: B023
            timed("tokenize_raw", lambda: encode_ids(tokenizer, texts))  # noqa: B023
            timed("tokenize_rendered", lambda: encode_ids(tokenizer, rendered))  # noqa: B023
            rows += len(lines)
    out: dict[str, Any] = {f"{name}_s": round(value, 2) for name, value in times.items()}
    out.update({f"{name}_rows_per_s": round(rows / value, 1) for name, value in times.items() if value})
    return out


def format_pipeline(report: dict[str, Any]) -> str:
    r = report["results"]
    return "\n".join([
        f"null-engine pipeline, {r['rows']:,} rows, {r['cores']} cores",
        f"  qbatch run (null engine)        {r['pipeline_rows_per_s']:>10,.0f} rows/s  {r['pipeline_s']:>7.1f}s  "
        f"cpu {r['pipeline_cpu_utilization']:.2f} cores, peak RSS {r['rss_peak_mb']:,.0f} MB "
        f"(+{r['rss_growth_mb']:,.0f} MB)",
        f"  tokenize rendered prompts alone {r['tokenize_rendered_rows_per_s']:>10,.0f} rows/s  "
        f"{r['tokenize_rendered_s']:>7.1f}s  pipeline at {r['vs_tokenize_rendered']:.0%} of it",
        f"  tokenize raw prompts alone      {r['tokenize_raw_rows_per_s']:>10,.0f} rows/s  "
        f"{r['tokenize_raw_s']:>7.1f}s  pipeline at {r['vs_tokenize_raw']:.0%} of it",
        f"  stages alone: JSON parse {r['parse_s']:.1f}s, chat template {r['render_s']:.1f}s, "
        f"pre-scan (count_todo) {r['prescan_s']:.1f}s",
    ])


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _RssSampler:
    """Peak resident memory while the block runs, sampled every 20 ms from /proc/self/statm."""

    def __init__(self) -> None:
        self.start_mb = self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss_mb() -> float:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_mb = max(self.peak_mb, self._rss_mb())

    def __enter__(self) -> _RssSampler:
        self.start_mb = self.peak_mb = round(self._rss_mb(), 1)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = round(max(self.peak_mb, self._rss_mb()), 1)
