"""The Python door gives back the caller's kind of table (pandas in: pandas out; pyarrow: pyarrow; `frames=`
asks), a missing value in a DataFrame is its own row's problem, a result prints as a few lines, and errors
name keyword arguments, not the CLI's flags (null engine)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import qbatch
from qbatch.errors import SpecError
from qbatch.session import Session
from qbatch.session.keywords import for_python


@pytest.fixture(scope="module")
def session(bundled_model):
    with Session(bundled_model, backend="null") as session:
        yield session


ROWS = {"id": ["a", "b"], "prompt": ["hi", "hello there"]}


@pytest.mark.parametrize(("data", "frames", "kind"), [
    (pd.DataFrame(ROWS), None, pd.DataFrame), (pl.DataFrame(ROWS), None, pl.DataFrame),
    (pa.table(ROWS), None, pa.Table), ([{"id": "a", "prompt": "hi"}], None, pl.DataFrame),
    (pl.DataFrame(ROWS), "pandas", pd.DataFrame), (pd.DataFrame(ROWS), "polars", pl.DataFrame),
    (["hi"], "arrow", pa.Table)], ids=["pandas", "polars", "arrow", "dicts", "asked pandas", "asked polars",
                                       "asked arrow"])
def test_results_come_back_as_the_callers_kind_of_table(session, data, frames, kind):
    result = session.run(data, max_tokens=4, progress="none", frames=frames)
    assert isinstance(result.results, kind) and isinstance(result.errors, kind)
    assert list(result.results.column_names if kind is pa.Table else result.results.columns)[:3] == [
        "id", "source", "row_index"]


def test_embed_gives_the_callers_kind_and_frames_is_checked(session):
    assert isinstance(session.embed(pd.DataFrame({"id": ["a"], "prompt": ["x"]}), progress="none"), pd.DataFrame)
    with pytest.raises(SpecError, match="frames must be one of polars, pandas, arrow, got 'numpy'"):
        session.run(["hi"], frames="numpy")
    with pytest.raises(SpecError, match="frames does not apply to the quick paths"):
        session.generate(["hi"], frames="pandas")


def test_a_missing_value_is_its_own_rows_problem(session):
    """pandas' NaN turns a column of whole numbers into floats: every other row's max_tokens 5 was 5.0, which
    failed those rows (bad_param) while the row with the NaN went through. A column of mixed values (text,
    a number, a NaN) sent the number and the NaN as the text "5" and "nan"."""
    frame = pd.DataFrame({"id": ["a", "b", "c"], "prompt": ["hi", "yo", "hey"], "max_tokens": [5, np.nan, 3]})
    result = session.run(frame, max_tokens=16, progress="none", frames="polars")
    assert result.errors.height == 0 and result.results["completion_tokens"].to_list() == [5, 16, 3]
    mixed = pd.DataFrame({"id": ["a", "b", "c", "d"], "prompt": ["hi", 5, np.nan, None]})
    result = session.run(mixed, max_tokens=4, progress="none", frames="polars")
    assert result.results["id"].to_list() == ["a"]
    assert dict(zip(result.errors["id"], result.errors["error"], strict=True)) == {
        "b": "bad_prompt", "c": "empty_prompt", "d": "empty_prompt"}
    polars = session.run(pl.DataFrame({"id": ["a", "b"], "prompt": ["hi", None], "seed": [1, None]}), max_tokens=4,
                         progress="none")
    assert polars.results["id"].to_list() == ["a"] and polars.errors["error"].to_list() == ["empty_prompt"]


def test_a_result_prints_as_a_few_lines(session, tmp_path):
    result = session.run(["hi", "there"], max_tokens=4, progress="none", output_dir=tmp_path / "out")
    text = repr(result)
    assert len(text.splitlines()) <= 8 and len(text) < 700 and "DataFrame" not in text
    assert text.splitlines()[0] == f"RunResult: 2 result rows, 0 error rows (polars; {tmp_path / 'out'})"
    lines = str(result.summary).splitlines()
    assert lines[0] == "qbatch run completed: 2 rows ok, 0 failed"
    assert "flag: 2 of 2 rows were cut at max_tokens (finish_reason length): raise max_tokens= if the answers must " \
           "be whole" in lines  # the null engine stops every row at max_tokens
    assert lines[-1] == f"output {tmp_path / 'out'}"
    assert result.summary.rows_ok == 2 and result.summary._repr_html_().startswith("<div><b>qbatch run completed")
    assert "\noutput " not in str(session.run(["hi"], progress="none").summary)  # a temporary folder, removed


def test_errors_name_keyword_arguments_not_flags(session, bundled_model):
    with pytest.raises(SpecError) as caught:
        session.run(["hi"], thinking_token_budget=10)
    assert caught.value.message.startswith("thinking_token_budget= needs a reasoning parser")
    assert caught.value.hint == "pass reasoning_parser=NAME (vLLM's parser names)"
    with pytest.raises(SpecError) as caught:
        qbatch.run(["hi"], model=bundled_model, backend="null", thinking_token_budget=10)
    assert "--" not in str(caught.value) + caught.value.hint


def test_flags_become_keywords_in_one_place():
    assert for_python("raise --max-tokens or pass --no-thinking") == "raise max_tokens= or pass thinking=False"
    assert for_python("pass --engines-per-gpu 2 for it") == "pass engines_per_gpu=2 for it"
    assert for_python("add --structured-outputs-backend xgrammar") == "add structured_outputs_backend='xgrammar'"
    assert for_python("--lora NAME=PATH, or in a job file") == "lora={'NAME': 'PATH'}, or in a job file"
    assert for_python("see --raw, --template, --shard I/N") == "see raw=True, template=, shard=I/N"
    assert for_python("run `qbatch run --help`; --server URL") == "run `qbatch run --help`; --server URL"  # no settings
