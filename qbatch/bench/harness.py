"""Benchmarks: synthetic workloads run side by side through raw vLLM, qbatch and Transformers.

One process, one engine. The `qbatch` mode runs the whole `qbatch run` path
(a JSONL file on disk to Parquet) through `qbatch.jobs.runner.run`, whose engine
cache hands back the very engine the raw vLLM modes drive, so every mode runs
on the same engine settings and the same prompts. Output lengths are forced
(`ignore_eos` + per-row `max_tokens`), so every mode does the same work.
A qbatch run with more than one engine (two per GPU for a small model, the
default on large GPUs, or --variant engines_per_gpu=2) cannot share the raw
modes' engine: it runs after them, once their engine is gone, on engines
started before its timing begins. So does every qbatch run with --vllm-defaults,
where the raw modes' engine has vLLM's own settings and qbatch keeps its own.

vLLM and torch are imported inside functions only. The null-engine benchmark of
qbatch's own pipeline is in pipeline.py, the workloads in workloads.py, the settings in settings.py.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qbatch.bench.settings import (
    DEFAULT_ROWS, MODES, QBATCH_MODES, BenchSettings, environment, qbatch_spec, work_dir,
)
from qbatch.bench.workloads import Workload, make_workload

BASELINES = ("vllm-tokens", "vllm-text")  # each mode's ratio to these, on the same workload
HF_MAX_BATCH = 256


# -- measurements ---------------------------------------------------------------
@dataclass
class Measurement:
    workload: str
    mode: str
    rows: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        wall = self.wall_s or float("nan")
        return {**asdict(self), "wall_s": round(self.wall_s, 3), "rows_per_s": round(self.rows / wall, 2),
                "output_tok_s": round(self.output_tokens / wall, 1),
                "total_tok_s": round((self.prompt_tokens + self.output_tokens) / wall, 1)}


def run_bench(settings: BenchSettings, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every mode on every workload; return the report (see `format_table`)."""
    from qbatch.jobs.job import Job

    settings.validate()
    with work_dir(settings.work_dir) as work:
        (work / "placeholder.jsonl").write_text('{"prompt": "hi"}\n')
        spec = qbatch_spec(settings, work / "placeholder.jsonl", work / "out", shared=True)
        job = Job.setup(spec)
        workloads = _workloads(settings, job.preparer.tokenizer, work, log)
        measurements: list[Measurement] = []
        if "hf" in settings.modes:  # before vLLM takes the GPU's memory
            for workload in workloads.values():
                measurements.append(_run_hf(job.model_path, spec.engine, workload, settings.hf_rows))
                log(_line(measurements[-1]))
            _free_torch_memory()
        engine_info: dict[str, Any] = {}
        if set(settings.modes) - {"hf"}:
            engine, engine_info = _engine(settings, spec, job)
            log(f"engine ready in {engine_info['start_s']:.1f}s: {engine_info['settings']}")
            # vLLM's defaults engine is not in qbatch.engines.factory's cache, which the CLI closes
            release = engine.close if settings.vllm_defaults else _keep
            try:
                _run_engine_modes(settings, engine.llm, workloads, work, job, measurements, log, release)
            finally:
                release()
    return _report(settings, workloads, measurements, engine_info)


def _keep() -> None:
    """The shared engine stays: it is qbatch.engines.factory's, closed with the others."""


def _run_engine_modes(settings: BenchSettings, llm: Any, workloads: dict[str, Workload], work: Path, job: Any,
                      measurements: list[Measurement], log: Callable[[str], None],
                      release_shared: Callable[[], None]) -> None:
    _warm_up(llm, embeds=settings.embeds)
    sequence = _vllm_modes(settings)
    specs = {(w, i): qbatch_spec(settings, work / f"{w}.jsonl", work / f"out-{w}", variant)
             for w in workloads for i, (mode, variant) in enumerate(sequence) if mode in QBATCH_MODES}
    own = {i for (_, i), spec in specs.items() if settings.vllm_defaults or _engine_processes(spec) > 1}
    runs: dict[tuple[str, int], list[Measurement]] = {(w, i): [] for w in workloads for i in range(len(sequence))}
    for workload in workloads.values():
        for repeat in range(settings.repeats):
            # Alternate the order: on the H200 the first mode after start ran fastest, so a
            # fixed order would favour one mode; forward then backward cancels a steady drift.
            for i in [i for i in range(len(sequence)) if i not in own][::-1 if repeat % 2 else 1]:
                llm.reset_prefix_cache()  # each mode starts cold: the same prompts ran just before
                if sequence[i][0] in QBATCH_MODES:
                    runs[workload.name, i].append(_run_qbatch(specs[workload.name, i], workload, sequence[i]))
                else:
                    runs[workload.name, i].append(_run_vllm(llm, workload, sequence[i][0], job.preparer.base_sampling))
                log(_line(runs[workload.name, i][-1]))
    if own:
        release_shared()
        _close_engines()  # their GPU memory goes to the runs with engines of their own
    for i in sorted(own):
        for workload in workloads.values():
            started = _start_engines(specs[workload.name, i])
            for _ in range(settings.repeats):
                runs[workload.name, i].append(_run_qbatch(specs[workload.name, i], workload, sequence[i], started))
                log(_line(runs[workload.name, i][-1]))
        _close_engines()
    measurements.extend(_mean(runs[w, i]) for w in workloads for i in range(len(sequence)))


def _engine_processes(spec: Any) -> int:
    """The engines a run of this spec would start, as Job.setup resolves them (it loads no tokenizer)."""
    from qbatch.jobs.job import Job

    return Job.setup(spec).spec.engine.engine_count()


def _start_engines(spec: Any) -> float:
    """Start a qbatch run's own engines (kept in qbatch.engines.factory's cache for its runs); the seconds it took."""
    from qbatch.engines import factory as engines
    from qbatch.jobs.job import Job

    started = time.monotonic()
    job = Job.setup(spec)  # resolves the engines per GPU as the run will
    engine = engines.create(job.spec.engine, job.model_path, job.max_model_len)
    getattr(engine, "wait_started", lambda: None)()  # a run begins on the first engine ready; timing waits for all
    return time.monotonic() - started


def _close_engines() -> None:
    from qbatch.engines import factory as engines

    engines.close_all()
    _free_torch_memory()
    _wait_for_gpu_memory()


def _wait_for_gpu_memory(timeout_s: float = 60.0) -> None:
    """Wait until the GPUs in use are (nearly) empty: the driver may hand back the memory of an
    engine process a moment after it exited, and the next engines would find too little free."""
    from qbatch.engines.placement import query_gpus

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() or None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage = query_gpus("memory.used,memory.total", visible)
        if usage is None or all(used < 0.05 * total for used, total in usage):
            return  # no NVIDIA GPU, or they are empty
        time.sleep(0.5)


def _mean(runs: list[Measurement]) -> Measurement:
    """One measurement per mode: the mean wall time of its repeats (the work is identical)."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    walls = [m.wall_s for m in runs]
    return Measurement(first.workload, first.mode, first.rows, sum(walls) / len(walls), first.prompt_tokens,
                       first.output_tokens, {**first.notes, "wall_s_runs": [round(w, 3) for w in walls]})


def write_workloads(settings: BenchSettings, *, log: Callable[[str], None] = print) -> list[Path]:
    """Write each workload's JSONL file into settings.work_dir (to time `qbatch run` on its own)."""
    from qbatch.models import registry as models
    from qbatch.inputs.prepare import load_tokenizer

    settings.validate()
    spec = qbatch_spec(settings, Path("unused.jsonl"), Path("unused"))
    tokenizer = load_tokenizer(spec.engine.tokenizer or models.resolve(spec.engine.model), spec.engine.revision)
    with work_dir(settings.work_dir) as work:
        _workloads(settings, tokenizer, work, log)
        return [work / f"{name}.jsonl" for name in settings.workloads]


def _workloads(settings: BenchSettings, tokenizer: Any, work: Path, log: Callable[[str], None]) -> dict[str, Workload]:
    workloads = {}
    for name in settings.workloads:
        rows = settings.rows or DEFAULT_ROWS[name]
        workloads[name] = make_workload(name, tokenizer, rows, seed=settings.seed, scale=settings.length_scale)
        workloads[name].write_jsonl(work / f"{name}.jsonl")
        log(f"workload {name}: {workloads[name].describe()}")
    return workloads


def _vllm_modes(settings: BenchSettings) -> list[tuple[str, dict[str, Any]]]:
    modes = [(mode, {}) for mode in MODES if mode in settings.modes and mode != "hf"]
    return modes + [("qbatch", variant) for variant in settings.variants]


def _engine(settings: BenchSettings, spec: Any, job: Any) -> tuple[Any, dict[str, Any]]:
    """The engine every mode shares: the one `qbatch run` gets from qbatch.engines.factory's cache."""
    from qbatch.engines import factory
    from qbatch.engines.vllm import VllmEngine

    started = time.monotonic()
    if settings.vllm_defaults:
        engine = VllmEngine(spec.engine, job.model_path, job.max_model_len, tuned=False)
    else:
        engine = factory.create(spec.engine, job.model_path, job.max_model_len)
    config = engine.llm.llm_engine.vllm_config
    info = {"start_s": round(time.monotonic() - started, 2), "settings": {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "enforce_eager": config.model_config.enforce_eager,
        "max_model_len": config.model_config.max_model_len,
        "performance_mode": getattr(config, "performance_mode", None),
        "max_cudagraph_capture_size": getattr(config.compilation_config, "max_cudagraph_capture_size", None),
        "vllm_defaults": settings.vllm_defaults}}
    return engine, info


def _warm_up(llm: Any, *, embeds: bool = False) -> None:
    """A few tiny requests, so no mode pays the first step's one-time costs."""
    from vllm import SamplingParams

    if embeds:
        llm.embed([{"prompt_token_ids": [100 + i] * 8} for i in range(8)], use_tqdm=False)
        return
    llm.generate([{"prompt_token_ids": [100 + i] * 8} for i in range(8)],
                 SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)


def _run_vllm(llm: Any, workload: Workload, mode: str, base_sampling: dict[str, Any]) -> Measurement:
    """One LLM.generate call with every prompt, as text or as token ids (an embed workload: LLM.embed,
    vLLM's default pooling: last token, normalized)."""
    from vllm import SamplingParams

    if workload.task == "embed":
        prompts = workload.prompts if mode == "vllm-text" else [{"prompt_token_ids": i} for i in workload.prompt_token_ids]
        started = time.monotonic()
        outputs = llm.embed(prompts, use_tqdm=False)
        wall = time.monotonic() - started
        return Measurement(workload.name, mode, len(outputs), wall, sum(len(o.prompt_token_ids) for o in outputs), 0)

    constraint: dict[str, Any] = {}
    if workload.structured_outputs is not None:  # the grammar ends a constrained row (as in qbatch's rows)
        from vllm.sampling_params import StructuredOutputsParams

        constraint = {"structured_outputs": StructuredOutputsParams(**workload.structured_outputs), "ignore_eos": False}
    params = [SamplingParams(**{**base_sampling, "max_tokens": n, "ignore_eos": True, **constraint})
              for n in workload.max_tokens]
    if mode == "vllm-text":
        prompts: list[Any] = workload.prompts
    else:
        prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids]
    started = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - started
    return Measurement(workload.name, mode, len(outputs), wall, sum(len(o.prompt_token_ids) for o in outputs),
                       sum(len(o.outputs[0].token_ids) for o in outputs))


def _run_qbatch(spec: Any, workload: Workload, mode: tuple[str, dict[str, Any]], engines_start_s: float | None = None
                ) -> Measurement:
    """The full `qbatch run` path, in-process (JSONL -> tokenize -> plan -> engine -> Parquet), or a warm
    Session's call on the workload's rows as a notebook passes them (a list of dicts)."""
    name, variant = mode
    started = time.monotonic()
    summary = _run_session(spec, workload) if name == "session" else _run_job(spec)
    wall = time.monotonic() - started
    name += "".join(f" {k}={v}" for k, v in variant.items())
    notes = {"engine_start_s": round(summary.engine_start_s, 2), "generate_s": round(summary.generate_s, 2),
             "overhead_s": round(wall - summary.generate_s, 3), "chunks": summary.num_chunks,
             "rows_failed": summary.rows_failed, "engines": spec.engine.engine_count()}
    if engines_start_s is not None:  # started before the timing, after the shared engine had gone
        notes["own_engines_start_s"] = round(engines_start_s, 2)
    if summary.prompt_tokens != workload.num_prompt_tokens:
        notes["prompt_tokens_expected"] = workload.num_prompt_tokens
    return Measurement(workload.name, name, summary.rows_ok, wall, summary.prompt_tokens, summary.completion_tokens,
                       notes)


def _run_job(spec: Any) -> Any:
    from qbatch.jobs.runner import run

    return run(spec)


def _run_session(spec: Any, workload: Workload) -> Any:
    """One call of a Session on the engines these settings already run (the bench's cache keeps
    them, as a notebook's Session would): what a second call in a notebook costs."""
    from qbatch.session.session import ENGINE_SETTINGS, Session

    session = Session.for_spec(spec)
    rows = [{"id": f"{workload.name}-{i}", "prompt": text, "max_tokens": max_tokens}
            for i, (text, max_tokens) in enumerate(zip(workload.texts, workload.max_tokens, strict=True))]
    flat = spec.flat()
    job = {key: value for key, value in flat.items() if key not in ENGINE_SETTINGS
           and key not in ("inputs", "output_dir", "restart") and value != _default(key)}
    return session.run(rows, **job).summary  # not closed: the engines are the bench's, closed with the others


def _default(key: str) -> Any:
    from qbatch.spec import JobSpec

    return JobSpec().flat()[key]


def _run_hf(model_path: str, engine_spec: Any, workload: Workload, num_rows: int) -> Measurement:
    """Transformers generate() in static, left-padded batches; tok/s counts only the useful tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        if engine_spec.load_format == "dummy":
            config = AutoConfig.from_pretrained(model_path)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    # Static batches of similar prompt lengths (as a careful Transformers user would cut them);
    # each batch still runs to its longest max_tokens, which is what static batching costs.
    rows = sorted(range(min(num_rows, workload.num_rows)), key=lambda i: len(workload.prompt_token_ids[i]))
    batch_size = min(HF_MAX_BATCH, len(rows))
    started = time.monotonic()
    for begin in range(0, len(rows), batch_size):
        batch = rows[begin:begin + batch_size]
        width = max(len(workload.prompt_token_ids[i]) for i in batch)
        ids = [[0] * (width - len(workload.prompt_token_ids[i])) + workload.prompt_token_ids[i] for i in batch]
        mask = [[0] * (width - len(workload.prompt_token_ids[i])) + [1] * len(workload.prompt_token_ids[i])
                for i in batch]
        new = max(workload.max_tokens[i] for i in batch)
        with torch.inference_mode():
            model.generate(input_ids=torch.tensor(ids, device=device), attention_mask=torch.tensor(mask, device=device),
                           max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.monotonic() - started
    del model
    return Measurement(workload.name, "hf", len(rows), wall, sum(len(workload.prompt_token_ids[i]) for i in rows),
                       sum(workload.max_tokens[i] for i in rows), {"batch_size": batch_size, "device": device})


def _free_torch_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- report ---------------------------------------------------------------------
def _report(settings: BenchSettings, workloads: dict[str, Workload], measurements: list[Measurement],
            engine_info: dict[str, Any]) -> dict[str, Any]:
    rows = [m.as_dict() for m in measurements]
    for row in rows:
        for baseline in BASELINES:
            base = next((r for r in rows if r["workload"] == row["workload"] and r["mode"] == baseline), None)
            rate = "output_tok_s" if base and base["output_tok_s"] else "total_tok_s"  # embeddings: input tok/s
            row[_ratio_key(baseline)] = round(row[rate] / base[rate], 3) if base and base[rate] else None
    return {"kind": "engines", **environment(), "settings": {**asdict(settings), "work_dir": None},
            "engine": engine_info, "workloads": {name: w.describe() for name, w in workloads.items()},
            "results": rows}


def format_table(report: dict[str, Any]) -> str:
    """The side-by-side table `qbatch bench` prints."""
    if report["kind"] == "pipeline":
        from qbatch.bench.pipeline import format_pipeline

        return format_pipeline(report)
    head = f"{'workload':<9} {'mode':<26} {'rows':>6} {'wall s':>8} {'rows/s':>9} {'out tok/s':>10} " \
           f"{'total tok/s':>11} " + " ".join(f"{'vs ' + b:>15}" for b in BASELINES) + "  wall s of each run"
    lines = [head]
    for r in report["results"]:
        ratios = " ".join(f"{r[_ratio_key(b)]:>14.3f}x" if r.get(_ratio_key(b)) is not None else f"{'-':>15}"
                          for b in BASELINES)
        runs = " ".join(f"{w:.2f}" for w in r["notes"].get("wall_s_runs", []))  # the spread says how far to trust a ratio
        lines.append(f"{r['workload']:<9} {r['mode']:<26} {r['rows']:>6} {r['wall_s']:>8.2f} {r['rows_per_s']:>9.1f} "
                     f"{r['output_tok_s']:>10,.0f} {r['total_tok_s']:>11,.0f} {ratios}  {runs}".rstrip())
    return "\n".join(lines)


def _ratio_key(baseline: str) -> str:
    return "vs_" + baseline.replace("-", "_")


def _line(m: Measurement) -> str:
    d = m.as_dict()
    return (f"{m.workload} {m.mode}: {m.rows} rows in {d['wall_s']:.2f}s, {d['output_tok_s']:,.0f} output tok/s, "
            f"{d['total_tok_s']:,.0f} total tok/s {m.notes or ''}")
