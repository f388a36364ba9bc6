"""qbatch.Session on the null engine: inputs, schema, errors, settings, resume, quick paths (no model runs)."""

from __future__ import annotations

import re
import subprocess
import sys

import polars as pl
import pytest

import qbatch
from qbatch.errors import InputError, SpecError
from qbatch.session import Session

RESULT_COLUMNS = ["id", "source", "row_index", "text", "reasoning", "finish_reason", "flag", "prompt_tokens",
                  "completion_tokens", "cached_tokens"]
ERROR_COLUMNS = ["id", "source", "row_index", "line", "error", "message"]


@pytest.fixture(scope="module")
def session(bundled_model):
    with Session(bundled_model, backend="null") as session:
        yield session


def _rows(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": "word " * (i % 5 + 1), "topic": i} for i in range(n)]


@pytest.mark.parametrize("kind", ["polars", "pandas", "dicts", "path"])
def test_run_reads_every_kind_of_data_into_the_cli_schema(session, kind, write_jsonl):
    rows = _rows(20)
    data = {"polars": lambda: pl.DataFrame(rows), "pandas": lambda: pl.DataFrame(rows).to_pandas(),
            "dicts": lambda: rows, "path": lambda: write_jsonl(rows)}[kind]()
    result = session.run(data, max_tokens=8, progress="none", frames="polars")  # pandas in gives pandas otherwise
    assert result.results.columns == ["id", "source", "row_index", "prompt", "topic", *RESULT_COLUMNS[3:]]
    assert result.results["id"].to_list() == [f"r{i}" for i in range(20)]
    assert result.results["topic"].to_list() == list(range(20))
    assert result.errors.columns == ERROR_COLUMNS and result.errors.height == 0
    assert result.summary.rows_ok == 20 and result.output_dir is None


def test_list_of_strings_gets_positions_as_ids(session):
    result = session.run(["hello", "world", "again"], progress="none")
    assert result.results.columns == [*RESULT_COLUMNS[:3], "prompt", *RESULT_COLUMNS[3:]]
    assert result.results["id"].to_list() == ["0", "1", "2"]
    assert result.results["prompt"].to_list() == ["hello", "world", "again"]


def test_bad_rows_become_error_rows(session):
    rows = [{"id": "ok", "prompt": "fine"}, {"id": "no-prompt", "text": "x"}, {"id": "number", "prompt": 5},
            {"id": "long", "prompt": "word " * 9000}]
    result = session.run(rows, max_tokens=8, progress="none")
    assert result.results["id"].to_list() == ["ok"]
    errors = dict(zip(result.errors["id"], result.errors["error"], strict=True))
    assert errors == {"no-prompt": "missing_prompt", "number": "bad_prompt", "long": "prompt_too_long"}


def test_temporary_folder_is_removed(session, monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    session.run(["hi"], progress="none")
    assert list(tmp_path.iterdir()) == []


def test_settings_are_checked_with_the_session_they_belong_to(session, bundled_model):
    with pytest.raises(SpecError, match="max_model_len is an engine setting, fixed for this session"):
        session.run(["hi"], max_model_len=512)
    session.run(["hi"], backend="null", progress="none")  # the session's own value is fine
    with pytest.raises(SpecError, match="unknown setting 'max_tokenz'"):
        session.run(["hi"], max_tokenz=5)
    with pytest.raises(SpecError, match="'max_tokens' is not an engine setting"):
        Session(bundled_model, max_tokens=5)
    with pytest.raises(InputError, match="cannot read data of type int"):
        session.run(5)
    with pytest.raises(InputError, match="only dicts or only strings"):
        session.run(["a", {"prompt": "b"}])


def test_sessions_of_one_pool_share_its_engine_and_leave_it_to_its_owner(bundled_model):
    """A pool handed to Sessions is its owner's: both run on its engine, started once, and closing them
    leaves it running; the owner closes it."""
    from qbatch.engines.base import NullEngine
    from qbatch.engines.pool import EnginePool

    class Kept(NullEngine):
        closed = False

        def close(self):
            self.closed = True

    started = []
    pool = EnginePool(start=lambda *args, **kwargs: started.append(Kept()) or started[-1])
    with Session(bundled_model, backend="null", pool=pool) as first, \
            Session(bundled_model, backend="null", pool=pool) as second:
        assert first.generate(["a"], max_tokens=2) and second.generate(["b"], max_tokens=2)
    assert len(started) == 1 and not started[0].closed and pool.engines() == started
    pool.close_all()
    assert started[0].closed


def test_output_dir_resumes_after_a_stopped_call(session, tmp_path):
    """A call stopped by its caller (`stop_request`, set here once rows are done) raises Stopped with its rows
    written; the same call again resumes."""
    from qbatch.errors import Stopped
    from qbatch.jobs.events import StopRequest

    out = tmp_path / "out"
    data = pl.DataFrame(_rows(60))
    stop = StopRequest()
    with pytest.raises(Stopped, match=r"the run stopped at the caller's request \(cancel\): \d+ rows done") as info:
        session.run(data, output_dir=out, chunk_tokens=200, max_tokens=16, progress="none",
                    on_progress=lambda done, failed: stop.request("cancel"), stop_request=stop)
    assert info.value.reason == "cancel" and info.value.hint == "run the same call again with output_dir= to resume"
    done = pl.read_parquet(out / "parts" / "*.parquet")["id"].to_list()
    assert 0 < len(done) < 60

    result = session.run(data, output_dir=out, chunk_tokens=200, max_tokens=16, progress="none")
    assert result.summary.rows_skipped == len(done) and result.summary.rows_ok == 60 - len(done)
    assert result.results["id"].to_list() == [f"r{i}" for i in range(60)]
    assert result.output_dir == str(out)


def test_generate_and_chat_return_texts_in_order(session):
    texts = session.generate(["one", "two two two two"], max_tokens=4)
    assert len(texts) == 2 and texts[0] != texts[1] and texts[0].startswith("[null engine")
    chats = session.chat([[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"},
                                                              {"role": "user", "content": "hello"}]])
    assert len(chats) == 2
    with pytest.raises(InputError, match=r"1 of 2 prompts failed; the first: empty_prompt") as exc:
        session.generate(["fine", "   "])
    assert exc.value.where == "prompt 1"


def test_quick_paths_raise_input_error_when_every_prompt_failed(session):
    with pytest.raises(InputError, match=r"2 of 2 prompts failed; the first: empty_prompt"):
        session.generate(["", "   "])
    with pytest.raises(InputError, match=r"1 of 1 prompts failed; the first: empty_prompt"):
        session.chat([[{"role": "user", "content": ""}]])
    replies = session.replies("prompt", ["", " "])
    assert [r.error for r in replies] == ["empty_prompt", "empty_prompt"] and replies[0].text is None
    result = session.run([{"id": "a", "prompt": "", "topic": 1}], progress="none")
    assert result.results.columns == ["id", "source", "row_index", "prompt", "topic", *RESULT_COLUMNS[3:]]
    assert result.results.height == 0 and result.errors.height == 1


def test_quick_paths_refuse_what_would_lose_or_split_answers(session):
    with pytest.raises(InputError, match="expected a list of prompts, got str") as exc:
        session.generate("hello")
    assert exc.value.hint == "generate([text]) for one prompt"
    with pytest.raises(InputError, match="got one conversation"):
        session.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(SpecError, match="n=3 asks for 3 answers a prompt; the quick paths return one") as exc:
        session.generate(["hi"], n=3)
    assert "sample_index" in exc.value.hint
    for setting in ({"limit": 1}, {"id_column": "x"}, {"template": "Q: {x}"}, {"prompt_column": "text"},
                    {"shard": "0/2"}, {"dry_run": True}):
        with pytest.raises(SpecError, match=f"{next(iter(setting))} does not apply to the quick paths"):
            session.generate(["a", "b"], **setting)
    with pytest.raises(InputError, match="a string is the path or glob of input files, and no file matches it"):
        session.run("What is the capital of France?")  # run and embed take paths as strings: a text is refused
    import pandas as pd

    assert len(session.generate(pd.Series(["a", "b"]), progress="none")) == 2  # any iterable of prompts
    assert session.generate(["hi"], n=1, progress="none")


def test_a_pandas_index_is_carried_or_is_the_id(session):
    import pandas as pd

    named = pd.DataFrame({"prompt": ["a", "b"]}, index=pd.Index(["x", "y"], name="doc"))
    result = session.run(named, progress="none")
    assert result.results["doc"].to_list() == ["x", "y"] and result.results["id"].to_list() == ["0", "1"]
    sliced = pd.DataFrame({"prompt": ["a", "b", "c"]}).iloc[1:]
    assert session.run(sliced, progress="none").results["index"].to_list() == [1, 2]
    ids = pd.DataFrame({"prompt": ["a", "b"]}, index=pd.Index(["p", "q"], name="id"))
    assert session.run(ids, progress="none").results["id"].to_list() == ["p", "q"]
    plain = session.run(pd.DataFrame({"prompt": ["a", "b"]}), progress="none")
    assert list(plain.results.columns) == [*RESULT_COLUMNS[:3], "prompt", *RESULT_COLUMNS[3:]]  # the default index is the position: row_index holds it
    with pytest.raises(InputError, match="column names must be text, got 0"):
        session.run(pd.DataFrame([["a", 1]]))
    with pytest.raises(InputError, match="several columns named 'prompt'"):
        session.run(pd.DataFrame([["a", "b"]], columns=["prompt", "prompt"]))


def test_the_tokenizer_loads_once_per_model(session):
    from qbatch.tokens import _load_tokenizer

    session.run(["warm"], progress="none")
    misses = _load_tokenizer.cache_info().misses
    session.run(["again"], progress="none")
    assert _load_tokenizer.cache_info().misses == misses


def test_top_level_run_mirrors_the_cli(bundled_model, tmp_path):
    result = qbatch.run(["hi", "there"], model=bundled_model, backend="null", output_dir=tmp_path / "o",
                        max_tokens=8, progress="none")
    assert result.results.height == 2 and (tmp_path / "o" / "results.parquet").is_file()
    from qbatch.jobs import runner  # the package of the run stays importable beside the function

    assert callable(runner.run)


def test_closed_session_refuses_calls(bundled_model):
    session = Session(bundled_model, backend="null")
    session.close()
    with pytest.raises(SpecError, match="this Session is closed"):
        session.run(["hi"])


def test_import_qbatch_stays_light():
    code = ("import sys, qbatch; qbatch.Session; "
            "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", "import sys, qbatch; assert 'polars' not in sys.modules"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_progress_is_a_notebook_bar_in_jupyter(session, monkeypatch, capsys):
    import tqdm.notebook

    from qbatch.session import progress

    bars = []

    class FakeBar:
        def __init__(self, total, **kwargs):
            self.total, self.done, self.lines, self.closed = total, 0, [], False
            bars.append(self)

        def update(self, n):
            self.done += n

        def set_postfix_str(self, text, refresh=True):
            pass

        def write(self, line, file=None):
            self.lines.append(line)

        def close(self):
            self.closed = True

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr(tqdm.notebook, "IProgress", object)  # ipywidgets installed
    monkeypatch.setattr(tqdm.notebook, "tqdm", FakeBar)
    session.run(["a", "b", "c"])
    assert len(bars) == 1 and bars[0].total == bars[0].done == 3 and bars[0].closed
    assert capsys.readouterr().err == ""  # under the bar, qbatch's events show only as warnings
    monkeypatch.undo()
    assert not progress.in_notebook()  # pytest is no Jupyter kernel


def test_a_row_with_text_that_is_not_unicode_fails_alone(session):
    result = session.run([{"id": "bad", "prompt": "a \ud800 b"}, {"id": "ok", "prompt": "fine"}], progress="none")
    assert result.results["id"].to_list() == ["ok"]
    assert result.errors["id"].to_list() == ["bad"] and result.errors["error"].to_list() == ["bad_text"]


def test_without_ipywidgets_jupyter_gets_the_text_bar_and_nothing_else(session, monkeypatch, capsys):
    import tqdm.notebook

    from qbatch.session import progress

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    monkeypatch.setattr(tqdm.notebook, "IProgress", None)
    session.run(["a", "b", "c"])
    err = capsys.readouterr().err
    assert [line for line in re.split(r"[\r\n]+", err) if line] == \
        [line for line in re.split(r"[\r\n]+", err) if re.match(r"\s*\d+%\|.*\| \d+/3 ", line)]
    assert "3/3" in err


def test_a_session_that_leaves_the_log_level_to_its_program_keeps_it_through_a_quiet_run(bundled_model):
    """qbatch serve's own lines (other threads) must show while a batch or its warm-up runs with progress
    none: the service's Session leaves the level alone (a run of it once hid "listening on")."""
    import logging

    from qbatch.log import log, setup

    setup("log")
    try:
        with Session(bundled_model, backend="null") as session:
            session.sets_log_level = False
            session.run(["hi"], max_tokens=1, progress="none")
            assert log.level == logging.INFO
            session.sets_log_level = True  # a Session of its own: progress none means warnings only
            session.run(["hi"], max_tokens=1, progress="none")
            assert log.level == logging.WARNING
    finally:
        setup("log")
