"""Starting and stopping the service: the data folder, the store, the worker, uvicorn, signals.

SIGTERM or SIGINT: uvicorn stops taking requests, the worker finishes the chunk it is on (the
running batch stays `in_progress` with its parts, and resumes on the next start), the engines
close. A second signal exits at once; the reaper (as for `qbatch run`) takes the engines along,
as it does when the service is killed outright.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from qbatch._fs import HolderLock, OpenFolder, private_folder
from qbatch.engines.pool import EnginePool
from qbatch.errors import LockedError, MissingDependency, SpecError
from qbatch.log import log
from qbatch.serve.config import SERVE_EXTRA_HINT, ServeSettings
from qbatch.serve.store import Store

STORE_NAME = "qbatch-serve.sqlite3"  # the queue and the file records (store.py)
SERVE_LOCK = ".qbatch-serve.lock"  # in the data folder: held by the live service (fcntl, as a run's OUT_DIR lock)
SHUTDOWN_WAIT_S = 600.0  # the longest the worker is waited for to finish its chunk (a second signal ends it)


def require_web_stack() -> None:
    """FastAPI and uvicorn (vLLM installs both); the `serve` extra names them."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(f"qbatch serve needs FastAPI and uvicorn ({exc.name} is missing)",
                                hint=SERVE_EXTRA_HINT) from None


class Service:
    """The store, the worker and the app of one data folder; `serve()` runs them until a signal."""

    def __init__(self, settings: ServeSettings, *, pool: EnginePool | None = None, close_pool: bool = False):
        """`pool`: the engines to run batches on, left open for its owner unless `close_pool` (default: a
        pool of the service's own, closed when it stops)."""
        require_web_stack()
        from qbatch.serve.app import create_app
        from qbatch.serve.worker import BatchWorker

        self.settings = settings
        _private_data_dir(settings.data_dir)
        self._lock = _lock_data_dir(settings.data_dir)
        self.store = Store(settings.data_dir / STORE_NAME)
        self.pool = pool if pool is not None else EnginePool(kept=True, gpu_room=False)  # engines at once: see EnginePool
        self._owns_pool = pool is None or close_pool
        self.worker = BatchWorker(self.store, settings, self.pool)
        self.app = create_app(settings, self.store, self.worker)

    def close(self) -> None:
        """The store closed, the data folder let go (once the worker has stopped)."""
        self.store.close()
        self._lock.release()

    def serve(self, *, on_ready: Any = None) -> None:
        import uvicorn

        from qbatch.jobs.runtime import this_process

        # the process's engine machinery, up until the process ends: the reaper kills the engines if this process
        # dies without a word (kill -9)
        this_process().start(reaper=self.settings.engine.get("backend") != "null")
        worker = self.worker

        def stopping(sig: int) -> None:
            log.info(f"serve: {signal.Signals(sig).name}: finishing the current chunk, the rest stays queued")
            worker.stop()

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if self.should_exit:  # the second signal: no more waiting
                    _exit_now(sig, frame)
                stopping(sig)
                # uvicorn's own graceful stop; it must find should_exit unset, or it takes a SIGINT for the
                # second one and exits at once (force_exit: its lifespan task cancelled, a traceback printed)
                super().handle_exit(sig, frame)

            def stop(self, sig: int, frame: Any) -> None:
                """A signal before uvicorn takes them over, or one it hands back once it has stopped:
                the service stops (once), it does not exit."""
                if not self.should_exit:
                    stopping(sig)
                self.should_exit = True

        server = Server(uvicorn_config(self.app, self.settings, timeout_graceful_shutdown=5))
        # Until uvicorn takes the signals over (its run has started), a signal is already a stop.
        previous = {sig: signal.signal(sig, server.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        worker.start()
        log.info(f"serve: listening on http://{self.settings.host}:{self.settings.port} "
                 f"(data {self.settings.data_dir}, model {self.settings.model})")
        try:
            server.run()
        finally:
            for sig in previous:  # uvicorn has put back the handlers it found: now a signal ends the wait
                signal.signal(sig, _exit_now)
            worker.stop()
            worker.join(SHUTDOWN_WAIT_S)
            if self._owns_pool:
                self.pool.close_all()
            self.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.info("serve: stopped")


def _lock_data_dir(data_dir: Path) -> HolderLock:
    """The data folder's lock, held while the service lives: two services on one folder would both run its
    queued batches (each then finds the other's run lock on the batch's folder and fails it)."""
    lock = HolderLock(data_dir / SERVE_LOCK)
    try:
        holder = lock.acquire()
    except OSError as exc:
        raise SpecError(f"cannot take the data folder's lock: {exc.strerror or exc}", where=str(data_dir),
                        hint="pass a --data-dir of the service's user") from None
    if holder is not None:
        raise LockedError(f"another qbatch serve is using this data folder ({holder})", where=str(data_dir),
                          hint="stop it first, or pass another --data-dir")
    return lock


def _private_data_dir(data_dir: Path) -> None:
    """The data folder holds every client's batches: only the service's user may enter it (0700). One open to
    others is made so when it is the service's (empty, or holding its store); another, someone's own folder,
    is refused rather than changed."""
    try:
        private_folder(data_dir, marker=STORE_NAME)
    except OpenFolder as exc:
        raise SpecError(f"the data folder holds other files and is open to other users (mode {exc.mode:04o}): it "
                        "would hold every client's batches", where=str(data_dir),
                        hint="pass a new --data-dir (the service makes it), or chmod 700 this one") from None
    except OSError as exc:
        raise SpecError(f"cannot make the data folder private to the service's user: {exc.strerror or exc}",
                        where=str(data_dir), hint="pass a --data-dir of the service's user") from None


def uvicorn_config(app: Any, settings: ServeSettings, **extra: Any) -> Any:
    """uvicorn's settings for the app. Proxy headers are never trusted (uvicorn trusts them from loopback by
    default): a client's address is its socket's peer, and `X-Forwarded-For: 127.0.0.1` from any local user
    would otherwise pass for a loopback client whose socket no one owns (runs.check_client)."""
    import uvicorn

    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                          proxy_headers=False, forwarded_allow_ips=[], **extra)


def _exit_now(sig: int, frame: Any) -> None:
    """The second signal: the worker's chunk is not waited for; the reaper takes the engines along."""
    log.warning("serve: second signal, exiting now")
    os._exit(128 + sig)


def serve_in_thread(settings: ServeSettings, *, pool: EnginePool | None = None
                    ) -> tuple[Service, Any, threading.Thread]:
    """The service on a uvicorn thread (for tests and notebooks): (service, uvicorn server, thread)."""
    import uvicorn

    service = Service(settings, pool=pool)
    server = uvicorn.Server(uvicorn_config(service.app, settings))
    thread = threading.Thread(target=server.run, name="qbatch-serve-http", daemon=True)
    service.worker.start()
    thread.start()
    return service, server, thread
