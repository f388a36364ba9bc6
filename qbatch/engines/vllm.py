"""vLLM's offline engine behind the Engine protocol (base.py): with platform.py, the only
modules that import vLLM (inside functions).

The engine keeps itself fed across chunk boundaries: it adds the next chunk's requests
while the current one is still running, so no chunk ends in an idle drain. Finished rows
go back as they finish, every REPORT_S (base.py), not when their whole chunk is done; an
urgent chunk's (an online request's) at the step they finish.
Its LLM(...) arguments come resolved in an EngineConfig (qbatch/plan/): it passes them on as they are.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import inspect
import os
import signal
import threading
import time
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from qbatch.engines import compile_cache
from qbatch.engines.base import END, REPORT_S, Chunk, urgent_door
from qbatch.engines.config import EngineConfig
from qbatch.engines.detokenize import FinalDecoder
from qbatch.engines.lora import LoraRequests
from qbatch.engines.messages import EngineSample
from qbatch.engines.platform import spawn_if_forks_lose_cuda
from qbatch.engines.scratch import scratch_folder
from qbatch.engines.start_errors import start_error, start_log
from qbatch.engines.vllm_output import EngineLog, engine_processes
from qbatch.engines.warm_up import run_warm_up
from qbatch.errors import EngineError, MissingDependency, first_line
from qbatch.log import log
from qbatch.records import Completion, Embedding, Request, Sample
from qbatch.tokens import TextEncoder, encode_prompts, load_tokenizer

# Requests kept in the engine, as a multiple of max_num_seqs: enough that the scheduler
# always has the next rows waiting when a sequence finishes, and that the longest rows of
# a later window get in early instead of running alone at the end (a smaller feed lost
# to plain vLLM: docs/benchmarks.md). While other engines are still starting, the
# coordinator keeps a running one to max_num_seqs rows (dispatch.py): rows waiting in it
# cannot go to another. An urgent chunk (an online request's) goes in past it (base.Stream).
FEED_FACTOR = 1.5
# An urgent chunk's rows (an online request's) on an engine with vLLM's priority policy (`qbatch serve`'s):
# vLLM schedules lower values first, every other row has its default 0, so they go before the rows queued
# in the engine (up to (FEED_FACTOR - 1) x max_num_seqs of a batch's), not behind them.
URGENT_PRIORITY = -1
# Prompt tokens added between two engine steps, in steps' worth (max_num_batched_tokens each). vLLM's
# engine core takes in every request waiting in its input queue before its next step, so a chunk of
# thousands of rows added at once leaves the GPU idle while the core takes them in, as raw vLLM's
# generate() does at its start (docs/benchmarks.md, session 43). More than one step's worth a step
# keeps the core ahead of prefill, which consumes one a step.
ADD_STEPS = 2
IDLE_S = 0.002
SHUTDOWN_S = 30.0  # the most an engine's processes get to stop cleanly before vLLM kills them


@dataclass(slots=True)
class OpenChunk:
    """A chunk in the engine: its rows still running, and those finished since the last report, with
    the token ids still to turn into text."""

    chunk: Chunk
    remaining: int
    finished: list[Completion | Embedding] = dataclasses.field(default_factory=list)
    # 4 bytes a token: a Python list costs ~36 (2,000 rows of 2,048 tokens: 16 MB, not 150)
    undecoded: list[tuple[Completion, array[int]]] = dataclasses.field(default_factory=list)


class VllmEngine:
    """vLLM's offline engine, driven request by request so it never drains between chunks."""

    embeds = False  # an embedding engine (task "embed"): PoolingParams in, Embeddings out
    # telemetry: counted as requests finish, read by another thread once a second (sample())
    _log_stats = False
    _in_flight: dict[str, Any] = {}  # the running run's requests (replaced, never changed, here)
    _num_finished = _num_prompt_tokens = _num_cached_tokens = _num_generated_tokens = 0
    _log = EngineLog(None)  # where vLLM's output goes (vllm_output.py)
    _loras = LoraRequests()  # each row's LoRA adapter as vLLM's LoRARequest (none: the base model)
    _encoder: TextEncoder | None = None
    _prioritised = False  # vLLM's scheduling_policy is "priority": urgent rows get URGENT_PRIORITY

    @property
    def adapters(self) -> LoraRequests:
        """The LoRA adapters this engine serves (by name: `"name" in engine.adapters`)."""
        return self._loras

    def __init__(self, config: EngineConfig, rank: int = 0):
        # the plan's environment (plan/environment.py: the sampler, the compile cache, the cores), before vLLM reads it
        os.environ.update(config.env_of(rank))
        scratch_folder()  # vLLM's socket files in a folder removed at exit, not left in /tmp (scratch.py)
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise MissingDependency(
                "vLLM is not installed", hint="pip install 'qbatch[cpu]' (CPU) or 'qbatch[gpu]' (CUDA)"
            ) from None
        kwargs = config.kwargs()  # resolved before (qbatch/plan/): this engine passes them on as they are
        self.embeds = config.task == "embed"
        if config.platform != "cpu" and spawn_if_forks_lose_cuda():
            log.debug("torch was asked about CUDA in this process before the engine started: vLLM spawns its engine core")
        self.llm, self._log = start_llm(config.model, config.model_path, kwargs)
        try:
            self._loras = LoraRequests(config.lora)
            self._loras.load(self.llm.llm_engine, _engine_dead_errors())
            scheduler = self.llm.llm_engine.vllm_config.scheduler_config
            self.max_num_seqs, self.max_num_batched_tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
            self._prioritised = getattr(scheduler, "policy", "fcfs") == "priority"
            self._decoder = None if self.embeds else FinalDecoder.for_llm(self.llm)
            self._watchdog = EngineWatchdog(self.llm.llm_engine)
            # rows that come as text are encoded here, by the driver's tokenizer and rule (tokens.py)
            self._encoder = None if self.embeds else TextEncoder(
                load_tokenizer(kwargs.get("tokenizer") or config.model_path, kwargs.get("revision")))
            if config.warm_up:  # generation engines on a GPU (plan/resolve.py); before a worker's Ready
                self.warm_up()
        except BaseException:
            self._shutdown()  # the engine processes would outlive a worker that fails here
            raise
        self._next_id = 0
        self._log_stats = not kwargs.get("disable_log_stats", True)
        if config.compile_marker is not None:  # it compiled: the next job of these settings finds the cache warm
            compile_cache.note_compiled(config.compile_marker)

    def warm_up(self) -> float:
        """Run the warm-up batch (warm_up.py) outside run(): this engine's counters never count it. Its seconds."""
        return run_warm_up(self.llm)

    def sample(self) -> EngineSample:
        """This engine's counters now (telemetry): cheap, read from another thread once a second."""
        running = waiting = usage = None
        if self._log_stats:
            running, waiting, usage = _scheduler_gauges()
        return EngineSample(len(self._in_flight), self._num_finished, self._num_prompt_tokens, self._num_cached_tokens,
                            self._num_generated_tokens, running, waiting, usage)

    def telemetry(self) -> list[tuple[str, EngineSample]]:
        return [("engine 0", self.sample())]

    def close(self) -> None:
        """Shut the engine processes down now (shutdown_llm)."""
        self._watchdog.stop()
        self._shutdown()

    def is_alive(self) -> bool:
        """Whether the engine's processes still run (looked at now, not at the watchdog's next poll)."""
        return not self._watchdog.is_dead()

    def abort_unfinished(self) -> None:
        """Abort every request still in the engine (left by a run that stopped before its end)."""
        self._abort(list(getattr(self.llm.llm_engine.output_processor, "external_req_ids", ())))

    def _abort(self, request_ids: list[str]) -> None:
        if request_ids:
            with contextlib.suppress(Exception):  # an engine shutting down refuses; it is dropped anyway
                self.llm.llm_engine.abort_request(request_ids)

    def _shutdown(self) -> None:
        shutdown_llm(self.llm)

    def run(self, chunks: Iterable[Chunk | None]) -> Iterator[tuple[Chunk, list[Any]] | None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        target = int(self.max_num_seqs * FEED_FACTOR)
        per_step = ADD_STEPS * self.max_num_batched_tokens  # prompt tokens added between two steps
        chunk_iter, take_urgent = iter(chunks), urgent_door(chunks)
        open_chunks: dict[int, OpenChunk] = {}
        in_flight: dict[str, tuple[OpenChunk, int]] = {}  # request id -> (its chunk, its position there)
        pending: deque[tuple[OpenChunk, int]] = deque()  # rows of chunks taken, not added yet
        self._in_flight = in_flight
        exhausted = False
        reported = time.monotonic()
        add = functools.partial(self._add, engine, SamplingParams, RequestOutputKind)
        try:
            while True:
                while (urgent := take_urgent()) is not None:  # someone waits on it: in now, room or not
                    rows = self._open(urgent, open_chunks)
                    pending.extendleft(reversed(rows + self._make_room(len(rows), in_flight)))
                budget = per_step
                while budget > 0:
                    if not pending:
                        if exhausted or len(in_flight) >= target:
                            break
                        chunk = next(chunk_iter, END)
                        if chunk is END:
                            exhausted = True
                            break
                        if chunk is None:  # a live feed with nothing ready yet (data-parallel workers)
                            break
                        pending.extend(self._open(chunk, open_chunks))
                    state, pos = pending.popleft()
                    budget -= add(state, pos, in_flight)
                if in_flight:
                    try:
                        outputs = engine.step()
                    except (Exception, KeyboardInterrupt) as exc:
                        if isinstance(exc, KeyboardInterrupt) and not self._watchdog.dead:
                            raise
                        raise self._failed(exc) from exc
                    for output in outputs:
                        if output.finished and output.request_id in in_flight:
                            state, pos = in_flight.pop(output.request_id)
                            self._finish(state, pos, output)
                elif not exhausted:
                    time.sleep(IDLE_S)  # a live feed with nothing for us yet: wait without spinning
                # Finished rows go back every REPORT_S, and at once when nothing else runs (nothing
                # would finish after them): rows never wait in here for the end of a long one. An urgent
                # chunk's rows go back at the step they finish (base.Chunk), alone: the others keep
                # their period, which an urgent report does not restart.
                now = time.monotonic()
                if now - reported >= REPORT_S or (not in_flight and any(s.finished for s in open_chunks.values())):
                    reported = now
                    yield from self._report(open_chunks)
                elif any(s.finished and s.chunk.urgent for s in open_chunks.values()):
                    yield from self._report(open_chunks, urgent_only=True)
                if exhausted and not in_flight and not pending:
                    return
        finally:
            # A consumer that stops early (an error, Ctrl-C) leaves requests in the engine: abort them,
            # or the next run on this engine (kept in its pool) would step through them first.
            if in_flight:
                self._abort(list(in_flight))

    def _make_room(self, rows: int, in_flight: dict[str, tuple[OpenChunk, int]]) -> list[tuple[OpenChunk, int]]:
        """Running places for `rows` urgent rows on an engine scheduling by priority: the rows of the run it
        admitted last, aborted, to be added again behind the urgent ones (their few tokens computed again, as
        vLLM's own preemption does). vLLM admits a waiting request, whatever its priority, only while fewer
        than max_num_seqs run (it preempts for priority only when the KV cache runs short), so beside a batch
        that fills them an online request waited for the batch's first rows to end (docs/benchmarks.md#urgent-door).
        Urgent rows in flight run (they go first); the run's rows take the places left in the order they came."""
        if not self._prioritised:
            return []
        ours = [request_id for request_id, (state, _) in in_flight.items() if not state.chunk.urgent]
        places = self.max_num_seqs - (len(in_flight) - len(ours))  # what the run's rows can hold
        running = ours[:max(places, 0)]
        needed = rows - (places - len(running))
        victims = running[::-1][:max(needed, 0)]
        self._abort(victims)
        return [in_flight.pop(request_id) for request_id in victims]

    def _open(self, chunk: Chunk, open_chunks: dict[int, OpenChunk]) -> list[tuple[OpenChunk, int]]:
        """A chunk taken from the feed: its rows, to be added."""
        if self._encoder is not None:  # rows that came as text (tokens.py)
            encode_prompts(chunk.requests, self._encoder)
        state = open_chunks[chunk.index] = OpenChunk(chunk, len(chunk.requests))
        return [(state, pos) for pos in range(len(chunk.requests))]

    def _failed(self, exc: BaseException) -> EngineError:
        """The run's error when the engine fails mid-run: finished parts are kept and a rerun resumes."""
        cause = "the engine process died" if self._watchdog.dead or isinstance(exc, _engine_dead_errors()) \
            else first_line(exc)
        self._log.show_tail()
        return EngineError(f"the engine failed: {cause}", hint="finished parts are kept; rerun the same command to resume")

    def _add(self, engine: Any, SamplingParams: Any, RequestOutputKind: Any, state: OpenChunk, pos: int,
             in_flight: dict[str, tuple[OpenChunk, int]]) -> int:
        """Add one row of a chunk to the engine; its prompt tokens (what it adds to the engine's work).
        A row vLLM rejects fails alone (finished with its error); a dead engine stops the run."""
        request = state.chunk.requests[pos]
        try:
            if self.embeds:
                params = pooling_params()
            else:
                params = SamplingParams(**_vllm_sampling(request.sampling), output_kind=RequestOutputKind.FINAL_ONLY,
                                        detokenize=self._vllm_detokenizes(request))
            request_id = f"q{self._next_id}"
            self._next_id += 1
            # vLLM's own engine input (its TokensInput): a raw prompt would be parsed and rendered again
            # for every row, a path vLLM deprecates; the checks of length and ids stay vLLM's.
            priority = {"priority": URGENT_PRIORITY} if state.chunk.urgent and self._prioritised else {}
            engine.add_request(request_id, {"type": "token", "prompt_token_ids": request.prompt_token_ids}, params,
                               lora_request=self._loras.get(request.adapter), **priority)
        except _engine_dead_errors() as exc:  # the engine died between steps: no row's fault
            raise self._failed(exc) from exc
        except _rejected_errors() as exc:  # a row vLLM rejects fails alone
            error = f"vLLM rejected the request: {first_line(exc)}"
            state.finished.append(Embedding(request, None, error=error) if self.embeds else
                                  Completion(request, "", None, 0, error=error))
            state.remaining -= 1
            return 0
        in_flight[request_id] = (state, pos)
        return request.num_prompt_tokens

    def _vllm_detokenizes(self, request: Request) -> bool:
        """Whether vLLM decodes this row's text (else qbatch does, with the rows reported with it; see detokenize.py).

        Stop strings are matched on the text as it grows: only vLLM's own detokenizer can do that;
        logprobs carry each token's text, and n samples several texts: vLLM decodes those too.
        """
        sampling = request.sampling
        return (self._decoder is None or bool(sampling.get("stop")) or sampling.get("logprobs") is not None
                or sampling.get("n", 1) > 1)

    def _finish(self, state: OpenChunk, pos: int, output: Any) -> None:
        request = state.chunk.requests[pos]
        if self.embeds:  # vLLM's PoolingRequestOutput: outputs.data, a tensor
            state.finished.append(Embedding(request, output.outputs.data.float().cpu().numpy(),
                                            output.num_cached_tokens or 0))
        else:
            self._keep_completion(state, request, output)
        self._num_finished += 1
        self._num_prompt_tokens += request.num_prompt_tokens
        self._num_cached_tokens += output.num_cached_tokens or 0
        state.remaining -= 1

    def _report(self, open_chunks: dict[int, OpenChunk], urgent_only: bool = False
                ) -> Iterator[tuple[Chunk, list[Any]] | None]:
        """The rows finished since the last report (of urgent chunks only, or of all), a chunk at a time, their
        texts decoded in one batch (None when none finished); a chunk whose rows have all been reported is forgotten."""
        states = [s for s in open_chunks.values() if s.finished and (s.chunk.urgent or not urgent_only)]
        if not states:
            yield None
            return
        undecoded = [item for s in states for item in s.undecoded]
        if undecoded and self._decoder is not None:  # rows qbatch decodes (none without a decoder)
            texts = self._decoder.decode([c.request.prompt_token_ids for c, _ in undecoded], [ids for _, ids in undecoded])
            for (completion, _), text in zip(undecoded, texts, strict=True):
                completion.text = text
        for state in states:
            finished, state.finished, state.undecoded = state.finished, [], []
            if not state.remaining:
                del open_chunks[state.chunk.index]
            yield state.chunk, finished

    def _keep_completion(self, state: OpenChunk, request: Request, output: Any) -> None:
        """A generated row's Completion among its chunk's finished rows; its token ids kept when qbatch
        decodes them, with the others reported with it."""
        completion = output.outputs[0]
        top = request.sampling.get("logprobs")
        kept = Completion(
            request,
            completion.text,
            completion.finish_reason,
            len(completion.token_ids),
            output.num_cached_tokens or 0,
            logprobs=_token_logprobs(completion, top),
            more_samples=[Sample(o.text, o.finish_reason, len(o.token_ids), _token_logprobs(o, top))
                          for o in output.outputs[1:]],  # vLLM lists them by sample index
        )
        state.finished.append(kept)
        self._num_generated_tokens += sum(len(o.token_ids) for o in output.outputs)  # every sample's
        if not self._vllm_detokenizes(request):
            ids = array("I", completion.token_ids)
            # vLLM drops the stop token
            state.undecoded.append((kept, ids[:-1] if completion.finish_reason == "stop" else ids))


def start_llm(model: str, model_path: str, kwargs: dict[str, Any]) -> tuple[Any, EngineLog]:
    """vLLM's LLM(model_path, **kwargs) and its log (its processes' output goes there: vllm_output.py).
    A start that fails shows the log's last lines and raises qbatch's error for its cause (start_errors.py)."""
    from vllm import LLM

    with engine_processes() as engine_log:
        try:
            with start_log() as logged:
                return LLM(model=model_path, **kwargs), engine_log
        except Exception as exc:
            engine_log.show_tail()
            raise start_error(model, exc, "".join(logged)) from exc


def shutdown_llm(llm: Any) -> None:
    """Stop an LLM's engine processes now (not at interpreter exit: a run on vLLM 0.26 hung there), and
    wait until they are gone. They get SHUTDOWN_S, not vLLM's 5 s: on a busy machine an engine's own
    teardown took longer, and vLLM then killed it midway, leaking its shared memory (a resource_tracker
    warning at exit)."""
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is None:
        return
    if "timeout" in inspect.signature(shutdown).parameters:  # vLLM 0.2x's takes none
        shutdown(timeout=SHUTDOWN_S)
    else:
        shutdown()


def pooling_params() -> Any:
    """vLLM's PoolingParams of an embedding request: the pooled vector as the model gives it (qbatch
    truncates and normalizes it: output/embeddings.py). The switch is `normalize` where vLLM has it
    (0.2x), else `use_activation` (0.32: for task "embed" it is the normalization). A new object a
    request: vLLM fills in its defaults on it."""
    from vllm import PoolingParams

    fields = getattr(PoolingParams, "__struct_fields__", ())
    switch = "normalize" if "normalize" in fields else "use_activation"
    return PoolingParams(task="embed", **{switch: False})


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

    def is_dead(self) -> bool:
        """Whether an engine process is gone: known from the last poll, else looked at now."""
        return self.dead or not all(_running(child) for child in self._children)

    def _watch(self) -> None:
        while not self.dead:
            time.sleep(self.POLL_S)
            if self._stopped:
                return
            if not all(_running(child) for child in self._children):
                self.dead = True
        queue = getattr(self._client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(RuntimeError("engine core process died"))
        elif (main := threading.main_thread().ident) is not None:  # None only for a thread not started
            signal.pthread_kill(main, signal.SIGINT)


# vLLM's Prometheus names for its scheduler stats (kv_cache_usage_perc was gpu_cache_usage_perc before 0.10)
RUNNING_GAUGE, WAITING_GAUGE = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def _scheduler_gauges() -> tuple[int | None, int | None, float | None]:
    """Running and waiting requests and KV-cache usage (0..1), from vLLM's in-process Prometheus gauges."""
    try:
        from vllm.v1.metrics.reader import Gauge, get_metrics_snapshot

        gauges = {m.name: m.value for m in get_metrics_snapshot() if isinstance(m, Gauge)}
    except Exception:  # a vLLM without the reader, or a registry being changed: this second goes unrecorded
        return None, None, None
    usage = next((gauges[name] for name in KV_USAGE_GAUGES if name in gauges), None)
    running, waiting = gauges.get(RUNNING_GAUGE), gauges.get(WAITING_GAUGE)
    return (None if running is None else int(running), None if waiting is None else int(waiting),
            None if usage is None else float(usage))


def _running(process: Any) -> bool:
    import psutil

    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _engine_processes(llm_engine: Any) -> list[Any]:
    """The engine-core processes: vLLM's own list where it keeps one, else our direct children.

    Not every descendant: helpers such as torch.compile workers come and go, and one ending is
    no engine death (watching them stopped healthy runs mid-generation). A dead worker
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


def _vllm_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams kwargs: a constraint (a dict of StructuredOutputsParams kwargs, checked by
    qbatch.sampling) becomes vLLM's object."""
    constraint = sampling.get("structured_outputs")
    if constraint is None:
        return sampling
    from vllm.sampling_params import StructuredOutputsParams

    return {**sampling, "structured_outputs": StructuredOutputsParams(**constraint)}


def _token_logprobs(completion: Any, top: int | None) -> list[dict[str, Any]] | None:
    """vLLM's logprobs of a sample as qbatch's records: per output token its text, logprob and the
    `top` most likely alternatives (by rank; vLLM also lists the sampled token when it is not among them)."""
    if top is None or completion.logprobs is None:
        return None
    out = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):
        chosen = position.get(token_id)
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)
        out.append({"token": (chosen.decoded_token or "") if chosen else "",
                    "logprob": float(chosen.logprob) if chosen else None,
                    "top_logprobs": [{"token": lp.decoded_token or "", "logprob": float(lp.logprob)}
                                     for lp in ranked]})
    return out


def _engine_dead_errors() -> tuple[type[BaseException], ...]:
    """vLLM's error for a request sent to an engine whose process died (checked before each send)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return ()
    return (EngineDeadError,)


def _rejected_errors() -> tuple[type[BaseException], ...]:
    return (ValueError, TypeError, *_request_errors())


def _request_errors() -> tuple[type[BaseException], ...]:
    """vLLM's errors for a bad request: VLLMValidationError is no ValueError (vLLM 0.2x), and one
    escaping add_request ended the run with a traceback instead of failing its row."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)
