"""Many machines: `--backend ray` runs each engine in a Ray actor; this process stays the coordinator.

The coordinator (dispatch.py) reads, plans, writes parts, holds the lock and
keeps the manifest exactly as with one engine, so only this process writes
OUT_DIR (it need not be shared with the nodes); actors get token ids and
return completions. Ray Data's LLM processor is not used: it owns reading,
batching and writing, while qbatch's resume-by-id and exactly-once writes
live in the coordinator. Every node needs qbatch with its engine extra and
the model folder at the same path. `ray` is imported here alone, lazily.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from qbatch.engines.base import STARTUP_TIMEOUT_S, Chunk
from qbatch.engines.config import EngineConfig
from qbatch.engines.dispatch import STATS_S, Answers, Dispatcher, Feed, Worker, start_engine
from qbatch.engines.messages import Failed, Message, Stats, Stop, Want
from qbatch.engines.start_errors import MEMORY_HINT, memory_reason
from qbatch.errors import EngineError, MissingDependency, ModelError, QbatchError, first_line
from qbatch.log import log

LOCAL_OBJECT_STORE_BYTES = 256 << 20  # chunks are token ids: a few MB each
STOP_TIMEOUT_S = 30.0
LOG_FOLDER = "/tmp/ray/session_latest/logs"
StartWorkerEngine = Callable[[EngineConfig, int, int], Any]  # (config, rank on its node, engines on its node) -> engine
FORWARDED_ENV = ("VLLM_", "QBATCH_", "HF_")  # so an engine on another node is set up like a local one


class RayEngine(Dispatcher):
    """Implements the Engine protocol over `data_parallel_size` Ray actors, one per GPU (or per CPU slot).

    `start`: how each actor starts its engine, in the actor (dispatch.start_engine: vLLM; a test
    passes a stand-in, which Ray pickles to the actors).
    """

    def __init__(self, config: EngineConfig, start: StartWorkerEngine = start_engine):
        super().__init__()
        self._ray = import_ray()
        self._owns_ray = connect(self._ray, config)
        self._start = start
        self._actors: list[Any] = []
        self._nodes: dict[int, str] = {}  # each actor's Ray node id, by rank
        self._lost: set[str] = set()  # nodes the cluster lost during the run (each said once)
        self._polls: dict[Any, int] = {}  # each live actor's pending events() call -> its rank
        self._inbox: deque[Message] = deque()  # messages already fetched, not yet handed to the coordinator
        self._dead: set[int] = set()
        atexit.register(self.close)
        try:
            self._start_actors(config)
        except BaseException:
            self.close()
            raise

    def _start_actors(self, config: EngineConfig) -> None:
        ray = self._ray
        on_gpu = ray.cluster_resources().get("GPU", 0) > 0
        actor_class = ray.remote(EngineActor).options(
            max_concurrency=4,  # events() waits in a thread while submit() and stop() come in
            runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}},
            # One engine a node before two on one: engines sharing a node split its cores (CPU), and a
            # node that goes takes fewer engines with it. Nodes without the resource (a head started
            # with `--num-cpus 0 --num-gpus 0`) get none.
            scheduling_strategy="SPREAD",
            **({"num_gpus": config.kwargs()["tensor_parallel_size"]} if on_gpu else {"num_cpus": 1}),
        )
        worker = replace(config, backend="vllm", ray_address=None, data_parallel_size=1, engines_per_gpu=1)
        self._actors = [actor_class.remote(worker, self._start) for _ in range(config.data_parallel_size)]
        places = self._get([actor.where.remote() for actor in self._actors])
        nodes = [node for node, _, _ in places]
        local = _local_ranks(nodes)
        self._get([actor.start.remote(rank, *local[rank]) for rank, actor in enumerate(self._actors)])
        for rank, (actor, (node, host, pid)) in enumerate(zip(self._actors, places, strict=True)):
            self._nodes[rank] = node
            self._workers[rank] = Worker(rank, f"actor {rank} (node {short_id(node)}, {host}, pid {pid})", actor)
            self._polls[actor.events.remote()] = rank
        log.info("%d engine actors (%s) on %d Ray node(s): %s; their logs: %s on each node",
                 len(self._actors), "GPU" if on_gpu else "CPU", len(set(nodes)),
                 ", ".join(w.label for w in self._workers.values()), LOG_FOLDER)

    def _get(self, refs: list[Any]) -> list[Any]:
        """ray.get for start-up calls; a failing actor becomes the error it raised, or a ModelError."""
        ray = self._ray
        try:
            results: list[Any] = ray.get(refs, timeout=STARTUP_TIMEOUT_S)
            return results
        except ray.exceptions.GetTimeoutError:
            raise ModelError(f"the engine actors did not start within {STARTUP_TIMEOUT_S:.0f}s",
                             hint="the cluster may lack the GPUs or CPUs asked for: see `ray status`") from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, QbatchError):
                raise exc.cause from None
            _raise_if_memory(exc.cause or exc)
            raise ModelError(f"an engine actor could not start: {first_line(exc.cause or exc)}") from None
        except ray.exceptions.RayError as exc:
            _raise_if_memory(exc)
            raise ModelError(f"an engine actor died while starting: {first_line(exc)}",
                             hint="see the log above") from None

    def _send(self, worker: Worker, chunk: Chunk) -> None:
        worker.handle.submit.remote(chunk)  # its answer comes as an event

    def _receive(self, timeout: float) -> Message | None:
        ray = self._ray
        if not self._inbox and self._polls:
            ready, _ = ray.wait(list(self._polls), num_returns=1, timeout=timeout)
            if ready:
                rank = self._polls.pop(ready[0])
                try:
                    events = ray.get(ready[0])
                except ray.exceptions.RayError:  # the actor, its process or its node is gone
                    self._dead.add(rank)
                    self._say_if_node_lost(rank)
                    return None
                self._polls[self._workers[rank].handle.events.remote()] = rank
                self._inbox.extend(events)
        return self._inbox.popleft() if self._inbox else None

    def _is_alive(self, worker: Worker) -> bool:
        return worker.rank not in self._dead

    def _say_if_node_lost(self, rank: int) -> None:
        """Name the node a dead actor ran on when Ray shows it gone (a lost machine, not a lost process),
        once a node; the coordinator then says how many rows each of its actors held."""
        node = self._nodes.get(rank)
        if node is None or node in self._lost:
            return
        try:
            if node in {n["NodeID"] for n in self._ray.nodes() if n["Alive"]}:
                return
        except Exception:  # the cluster cannot say (its head is gone too): the coordinator's line alone
            return
        self._lost.add(node)
        ranks = [str(r) for r, n in sorted(self._nodes.items()) if n == node]
        log.warning("Ray node %s left the cluster with engine actor(s) %s; their rows in flight go to the other "
                    "actors", short_id(node), ", ".join(ranks))

    def close(self) -> None:
        """Stop the engines, then the actors; shut down the Ray cluster if this process started it."""
        ray, actors, self._actors = self._ray, self._actors, []
        if actors and ray.is_initialized():
            ray.wait([actor.stop.remote() for actor in actors], num_returns=len(actors), timeout=STOP_TIMEOUT_S)
            for actor in actors:
                ray.kill(actor)
        self._workers.clear()
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


class EngineActor:
    """One vLLM engine in a Ray actor; a thread keeps it fed across chunks, as a local engine is.

    The driver submits chunks and long-polls `events()`: the engine asking for more (Want),
    rows that finished (Finished) or its failure (Failed).
    """

    EVENT_WAIT_S = 1.0

    def __init__(self, config: EngineConfig, start: StartWorkerEngine = start_engine):
        self._config = config
        self._start = start
        self._tasks: queue.Queue[Any] = queue.Queue()
        self._events: queue.Queue[Any] = queue.Queue()
        self._open = 0  # chunks submitted and not yet done
        self._engine: Any = None
        self._thread: threading.Thread | None = None
        self._rank = 0  # the driver's name for this actor, given at start()
        self._stats_at = 0.0  # when events() last added the engine's counters (telemetry)

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, host name, pid): engines sharing a node split its cores."""
        import ray

        return ray.get_runtime_context().get_node_id(), platform.node(), os.getpid()

    def start(self, rank: int, local_rank: int, local_world: int) -> int:
        """Start the engine (rank: this actor's among all; local: among those on its node); its max_num_seqs."""
        config = self._config
        self._rank = rank
        for path in (config.model_path, config.kwargs().get("tokenizer")):
            if path and os.path.isabs(path) and not os.path.isdir(path):
                raise ModelError(f"model folder not found on Ray node {platform.node()}", where=path,
                                 hint="every node needs the model at the same path: a shared filesystem, or a copy")
        self._engine = self._start(config, local_rank, local_world)
        self._thread = threading.Thread(target=self._generate, name="qbatch-engine", daemon=True)
        self._thread.start()
        return int(self._engine.max_num_seqs)

    def submit(self, chunk: Chunk) -> None:
        self._open += 1
        self._tasks.put(chunk)

    def events(self) -> list[Message]:
        """What happened since the last call; waits up to EVENT_WAIT_S for something. About once a
        second the engine's counters come along (telemetry): the driver polls anyway."""
        try:
            events = [self._events.get(timeout=self.EVENT_WAIT_S)]
        except queue.Empty:
            events = []
        while not self._events.empty():
            events.append(self._events.get_nowait())
        if self._engine is not None and time.monotonic() - self._stats_at >= STATS_S:
            self._stats_at = time.monotonic()
            events.append(Stats(self._rank, self._engine.sample()))
        return events

    def _generate(self) -> None:
        try:
            chunks = Feed(self._tasks, ask=lambda: self._events.put(Want(self._rank)))
            answers = Answers(self._rank)
            for finished in self._engine.run(chunks):
                if finished is None:
                    continue
                message, chunk_done = answers.finished(*finished)
                if chunk_done:
                    self._open -= 1
                self._events.put(message)
        except BaseException as exc:  # the coordinator says so and stops
            self._events.put(Failed(self._rank, first_line(exc)))

    def stop(self) -> None:
        """Shut the engine down; chunks still in flight (an interrupted run) are not waited for."""
        self._tasks.put(Stop())
        if self._thread is not None and not self._open:
            self._thread.join(timeout=STOP_TIMEOUT_S)
        if self._engine is not None:
            self._engine.close()


def _raise_if_memory(exc: BaseException) -> None:
    """An actor that ran out of memory while starting is told from one whose model is missing."""
    reason = memory_reason(exc)
    if reason is not None:
        raise EngineError(f"an engine actor ran out of memory while starting: {reason}", hint=MEMORY_HINT) from None


def import_ray() -> Any:
    """Ray is an extra: a run without it stops with the install command, before any engine starts."""
    try:
        import ray
    except ImportError:
        raise MissingDependency("--backend ray needs Ray, which is not installed",
                                hint="pip install 'qbatch[ray]'") from None
    return ray


def connect(ray: Any, config: EngineConfig) -> bool:
    """Join --ray-address (or $RAY_ADDRESS), else start a private local cluster; True if this process owns it."""
    if ray.is_initialized():  # qbatch called from a Ray program: use its connection
        return False
    address = config.ray_address or os.environ.get("RAY_ADDRESS") or "local"  # "local": never a stray cluster
    # The actors' own logs (vLLM's, Ray's) stay in Ray's log folder on each node; errors come back as exceptions.
    options: dict[str, Any] = {"address": address, "logging_level": logging.WARNING, "log_to_driver": False}
    if address == "local":
        options.update(
            num_cpus=max(len(os.sched_getaffinity(0)), config.data_parallel_size),
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            include_dashboard=False,
            # a killed actor's engine process is killed too, not left holding its memory
            _system_config={"kill_child_processes_on_worker_exit_with_raylet_subreaper": True},
        )
    try:
        ray.init(**options)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:  # RuntimeError: GCS did not start
        raise EngineError(f"could not join the Ray cluster at {address}: {first_line(exc)}",
                          hint="check --ray-address (or RAY_ADDRESS) and `ray status` on the head node") from None
    return True


def short_id(node: str) -> str:
    """A Ray node id as qbatch's log names it: its first 8 hex digits (`ray list nodes` shows them whole)."""
    return node[:8]


def _local_ranks(nodes: list[str]) -> list[tuple[int, int]]:
    """(rank on its node, engines on its node) for each actor, given each actor's node."""
    per_node = Counter(nodes)
    seen: Counter[str] = Counter()
    ranks = []
    for node in nodes:
        ranks.append((seen[node], per_node[node]))
        seen[node] += 1
    return ranks
