"""Counts the real vLLM engines the suite starts, per test file, and prints them after the durations.

An engine start costs ~40 s on CI's two cores: the count per file is what keeps the suite's time in
check. Every vLLM engine runs its core in a process titled `VLLM::EngineCore` (vLLM's own title,
`EngineCore_DP<rank>` with data parallelism); a thread notes each such descendant of this process
(in-process engines, CLI runs and services the tests start) and the test running when it appeared.
With pytest-xdist each worker writes its own notes, and the controller, which watches nothing (every
engine is a worker's), adds them up.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

POLL_S = 0.5  # an engine core lives for seconds at the least: a poll this often sees every one
NOTES_ENV = "QBATCH_ENGINE_STARTS_DIR"


class EngineStarts:
    def __init__(self, notes_dir: Path):
        self.notes = notes_dir / f"starts-{os.getpid()}.jsonl"
        self.seen: set[tuple[int, float]] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="engine-starts", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _watch(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(POLL_S):
            try:
                children = me.children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                try:
                    key = (child.pid, child.create_time())
                    title = " ".join(child.cmdline())
                except psutil.Error:
                    continue
                if key not in self.seen and "::EngineCore" in title:
                    self.seen.add(key)
                    current = os.environ.get("PYTEST_CURRENT_TEST")
                    test = current.split(" ")[0] if current else "(between tests)"
                    with open(self.notes, "a", encoding="utf-8") as handle:
                        handle.write(json.dumps({"test": test, "at": time.time()}) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if NOTES_ENV not in os.environ:  # the controller (or a run without xdist) makes the folder; workers inherit it
        import tempfile

        os.environ[NOTES_ENV] = tempfile.mkdtemp(prefix="qbatch-engine-starts-")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # the controller of xdist's workers: their engines are theirs to note
    config._engine_starts = EngineStarts(Path(os.environ[NOTES_ENV]))  # type: ignore[attr-defined]
    config._engine_starts.start()  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    watcher = getattr(config, "_engine_starts", None)
    if watcher is not None:
        watcher.close()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    per_test: Counter[str] = Counter()
    for notes in Path(os.environ[NOTES_ENV]).glob("starts-*.jsonl"):
        for line in notes.read_text(encoding="utf-8").splitlines():
            per_test[json.loads(line)["test"]] += 1
    per_file: Counter[str] = Counter()
    for test, count in per_test.items():
        per_file[test.split("::")[0]] += count
    terminalreporter.section(f"vLLM engine starts: {sum(per_file.values())}")
    for path, count in per_file.most_common():
        terminalreporter.write_line(f"{count:4d}  {path}")
    for test, count in per_test.most_common():
        terminalreporter.write_line(f"{count:4d}  {test}", light=True)
