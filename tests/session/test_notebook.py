"""The README's notebook (examples/session.ipynb) runs top to bottom in a headless Jupyter kernel."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "session.ipynb"
BAR = re.compile(r"\s*\d+%\|.*\| \d+/\d+ ")  # tqdm's text bar, where ipywidgets is missing


def test_session_notebook_runs_headless(bundled_model, engine_pool, monkeypatch):
    engine_pool.close_all()  # the kernel starts an engine of its own: the memory of this process's goes back first
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")

    root = NOTEBOOK.parents[1]
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # the kernel sees what a user's would (conftest sets it)
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env_path) if p)  # this checkout's qbatch
    try:
        # kernel_name python3 with ipykernel installed here: the kernel runs this interpreter.
        client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(root)}})
        client.execute()
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = env_path
    results = {cell.source.splitlines()[-1]: _result(cell) for cell in notebook.cells if cell.cell_type == "code"}
    assert "prompt_too_long" in results['result.errors.select("id", "error", "message")  # r3 is longer than '
                                        'max_model_len: an error row, not a failed call']
    generated = results['session.generate(["Name three colours.", "What is 2 + 2?"], max_tokens=24, temperature=0)']
    assert [type(t) for t in ast.literal_eval(generated)] == [str, str]
    assert [type(t) for t in ast.literal_eval(results["[a.content for a in answers]"])] == [str, str]
    # a Session call shows its bar and nothing else (vLLM's output goes to the engine log); the first one
    # starts the engine
    first_run = next(cell for cell in notebook.cells if "session.run(" in cell.source)
    shown = [line for output in first_run.outputs if output.output_type == "stream"
             for line in re.split(r"[\r\n]+", output.text) if line.strip()]
    assert all(BAR.match(line) for line in shown), shown
    assert shown or any(output.output_type == "display_data" for output in first_run.outputs)  # a widget bar


def _result(cell) -> str:
    """The text of a code cell's value (its last expression), or ""."""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "execute_result":
            return output["data"]["text/plain"]
    return ""
