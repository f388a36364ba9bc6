"""A yardstick better than GPU utilization: how close a run came to its GPU's roofline (plan/roofline.py),
how long a job will take here (`--dry-run`), and what a run costs at a price per GPU-hour.

A finished run on a GPU qbatch has figures for gets `roofline` in its summary: the least time its work
could take and the run's share of it. Every finished run adds its rates to $QBATCH_CACHE/rates.jsonl,
which a dry run's estimate reads: the median share this model reached on this GPU (or, without a
roofline, its median output rate on this machine). What an estimate is based on is said with it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from qbatch.output.summary import Summary
from qbatch.log import log
from qbatch.models.registry import cache_dir, text_config
from qbatch.plan.roofline import ModelCost, Roofline, Work, gpu_peak, roofline

RATES_FILE = "rates.jsonl"
HISTORY_RUNS = 20  # the latest runs of a model on a machine an estimate reads


@dataclass(frozen=True)
class Estimate:
    """How long a job's generation should take here, and on what the figure rests."""

    seconds: float | None
    basis: str
    cost: float | None = None  # at the price per GPU-hour given

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": None if self.seconds is None else round(self.seconds, 1), "basis": self.basis,
                "cost": None if self.cost is None else round(self.cost, 4)}


def job_roofline(job: Any, work: Work) -> Roofline | None:
    """The roofline of `work` on the job's GPUs; None off a GPU, or where qbatch lacks the GPU's or model's figures."""
    machine = job.plan.machine
    gpu = gpu_peak(machine.gpu_name) if machine.platform == "cuda" else None
    cost = ModelCost.of_config(text_config(job.model_path) or {}, machine.model.weights_bytes)
    if gpu is None or cost is None:
        return None
    return roofline(work, cost, gpu, gpus=len(set(job.plan.engine.devices)) or 1)


def run_work(summary: Summary) -> Work:
    """A run's work as the roofline counts it: prompt tokens the prefix cache served cost nothing."""
    return Work(summary.prompt_tokens - summary.cached_tokens, summary.completion_tokens,
                summary.decode_context, summary.prefill_context)


def measure(job: Any, summary: Summary) -> None:
    """A finished run: its share of the roofline and its cost (in its summary), and its rates (in the history)."""
    line = job_roofline(job, run_work(summary))
    if line is not None and summary.generate_s > 0:
        summary.roofline = {"gpu": line.gpu, "gpus": line.gpus, "bound": line.bound, "seconds": round(line.seconds, 2),
                            "share": round(line.seconds / summary.generate_s, 4)}
    price = job.spec.output.price_per_gpu_hour
    if price is not None:
        summary.cost = round(summary.wall_s / 3600 * _gpus(job) * price, 4)
    if summary.generate_s > 0 and summary.completion_tokens and job.spec.engine.backend != "null":
        _remember(job, summary)  # the null engine's rates say nothing of this machine


def estimate(job: Any, work: Work) -> Estimate:
    """The generation time of `work` here: the roofline over the share this model reached on this GPU before,
    else its output rate here before, else the roofline alone (a floor), else nothing."""
    line = job_roofline(job, work)
    history = _history(job)
    price = job.spec.output.price_per_gpu_hour
    seconds, basis = None, "no GPU figures and no earlier run of this model here: no estimate"
    shares = [h["share"] for h in history if h.get("share")]
    rates = [h["output_tok_s"] for h in history if h.get("output_tok_s")]
    if line is not None and shares:
        share = statistics.median(shares)
        seconds = line.seconds / share
        basis = (f"the {line.gpu} roofline ({line.seconds:.1f}s, {line.bound}-bound, every row at max_tokens) over "
                 f"the median share of it {len(shares)} earlier runs of this model reached here ({share:.0%})")
    elif rates and work.output_tokens:
        rate = statistics.median(rates)
        seconds = work.output_tokens / rate
        basis = (f"the median output rate of {len(rates)} earlier runs of this model here ({rate:,.0f} tok/s), "
                 "every row at max_tokens")
    elif line is not None:
        seconds = line.seconds
        basis = (f"the {line.gpu} roofline alone ({line.bound}-bound, every row at max_tokens): a floor, no run "
                 "measures the time; no earlier run of this model here to scale it")
    cost = seconds / 3600 * _gpus(job) * price if seconds is not None and price is not None else None
    return Estimate(seconds, basis, cost)


def _gpus(job: Any) -> int:
    return len(set(job.plan.engine.devices)) or 1


def _machine_key(job: Any) -> str:
    machine = job.plan.machine
    return machine.gpu_name if machine.platform == "cuda" and machine.gpu_name else f"cpu x{machine.num_cores}"


def _remember(job: Any, summary: Summary) -> None:
    """One line of the run's rates in the history; a history that cannot be written is skipped (a warning)."""
    record = {"model": job.spec.engine.model, "machine": _machine_key(job), "gpus": _gpus(job),
              "output_tok_s": round(summary.output_tok_s, 1), "rows": summary.rows_ok,
              "share": (summary.roofline or {}).get("share"), "at": int(time.time())}
    path = cache_dir() / RATES_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as exc:
        log.warning(f"cannot record the run's rates in {path} ({exc.strerror}): estimates will not use it")


def _history(job: Any) -> list[dict[str, Any]]:
    """The latest runs of the job's model on this machine (and number of GPUs)."""
    path = cache_dir() / RATES_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    key = (job.spec.engine.model, _machine_key(job), _gpus(job))
    runs = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash: the others still count
        if isinstance(record, dict) and (record.get("model"), record.get("machine"), record.get("gpus")) == key:
            runs.append(record)
    return runs[-HISTORY_RUNS:]
