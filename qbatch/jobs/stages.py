"""A pipeline of stages, each in a thread of its own, started at once, stopped together.

qbatch's own work per window of rows is Python (read, parse, check, render the chat
template) and the tokenizer's batch encode (its own threads, outside the GIL). Run one
after the other they leave a core idle half of the time; as stages, the Python work of
one window runs beside the encode of the one before. A stage's error reaches the
consumer; the consumer closing (or failing) stops every stage within ~0.1 s.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from qbatch.log import carried

POLL_S = 0.1
_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Stages(Iterator[Any]):
    """`source` through `stages` (name, function): one thread per stage, `depth` items between stages.

    The first stage's thread also iterates `source`. Threads start in the constructor (or at
    start()), so a pipeline can fill while the caller does something else (the duplicate-id
    pre-scan); close() stops them.
    """

    def __init__(self, source: Iterable[Any], *stages: tuple[str, Callable[[Any], Any]], depth: int = 1,
                 start: bool = True):
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        inbox: Iterable[Any] = source
        for name, function in stages:
            outbox: queue.Queue[Any] = queue.Queue(maxsize=depth)
            # the job's lines from these threads are the job's (log.current_job)
            self._threads.append(threading.Thread(target=carried(self._run), args=(inbox, function, outbox),
                                                  name=name, daemon=True))
            inbox = self._drain(outbox)
        self._out = iter(inbox)
        if start:
            self.start()

    def start(self) -> None:
        """Start the threads (once; the constructor does unless told not to)."""
        for thread in self._threads:
            if thread.ident is None:
                thread.start()

    def __next__(self) -> Any:
        try:
            return next(self._out)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, inbox: Iterable[Any], function: Callable[[Any], Any], outbox: queue.Queue[Any]) -> None:
        try:
            for item in inbox:
                if not self._put(outbox, function(item)):
                    return
            self._put(outbox, _END)
        except BaseException as exc:  # handed downstream, raised by the consumer
            self._put(outbox, _Failed(exc))
        finally:
            close = getattr(inbox, "close", None)
            if close is not None:  # the source's files
                close()

    def _put(self, outbox: queue.Queue[Any], item: Any) -> bool:
        while not self._stop.is_set():
            try:
                outbox.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _drain(self, outbox: queue.Queue[Any]) -> Iterator[Any]:
        while not self._stop.is_set():
            try:
                item = outbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
