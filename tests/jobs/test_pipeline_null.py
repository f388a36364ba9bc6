"""The whole pipeline through the real CLI with the null engine (fast: no model runs).

The real engine runs the same paths in test_run_e2e.py; here the point is
reading, shapes, validation, chunking, parts, resume and final files.
"""

from __future__ import annotations

import gzip
import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from qbatch.errors import EXIT_INPUT, EXIT_LOCKED, EXIT_MISMATCH, EXIT_ROW_ERRORS, EXIT_USAGE



def test_plain_prompts_to_parquet_in_input_order(run_null, write_jsonl, tmp_path):
    rows = [{"id": f"r{i}", "prompt": "word " * (i % 7 + 1), "topic": i} for i in range(50)]
    out = tmp_path / "out"
    result = run_null(write_jsonl(rows), "-o", out, "--chunk-tokens", 400, "--max-tokens", 16)
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert df["id"].to_list() == [f"r{i}" for i in range(50)]
    assert df["topic"].to_list() == list(range(50))  # carried column keeps its type
    assert {"text", "reasoning", "finish_reason", "prompt_tokens", "completion_tokens", "row_index"} <= set(df.columns)
    assert len(list((out / "parts").glob("part-*.parquet"))) > 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["counts"] == {"rows_ok": 50, "rows_failed": 0}
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows_ok"] == 50 and stats["chunks"]
    assert "rows ok (this run)              50" in result.stdout


def test_parquet_gz_and_zst_inputs(run_null, tmp_path):
    import zstandard

    lines = [json.dumps({"id": f"a{i}", "prompt": f"hello {i}"}) for i in range(5)]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "\n".join(line.replace('"a', '"b') for line in lines).encode()))
    pl.DataFrame({"id": [f"c{i}" for i in range(5)], "prompt": ["x"] * 5}).write_parquet(tmp_path / "c.parquet")
    out = tmp_path / "out"
    result = run_null(tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.zst", tmp_path / "c.parquet", "-o", out)
    assert result.exit_code == 0, result.output
    ids = pl.read_parquet(out / "results.parquet")["id"].to_list()
    assert ids == [f"{p}{i}" for p in "abc" for i in range(5)]


def test_chat_openai_and_template_shapes(run_null, write_jsonl, tmp_path):
    chat = write_jsonl([{"id": "c1", "messages": [{"role": "user", "content": "hi"}]}], "chat.jsonl")
    openai = write_jsonl([{"custom_id": "o1", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
                          {"custom_id": "o2", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "Once upon", "max_completion_tokens": 4}}], "openai.jsonl")
    out = tmp_path / "out"
    result = run_null(chat, openai, "-o", out, "--include-prompt", "--output-format", "jsonl-openai")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert df["id"].to_list() == ["c1", "o1", "o2"]
    assert df["completion_tokens"].to_list() == [2048, 3, 4]  # the null engine "generates" max_tokens
    prompts = df["prompt"].to_list()
    assert "<|im_start|>user\nhi<|im_end|>" in prompts[0] and prompts[2] == "Once upon"  # completions: no template
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["c1", "o1", "o2"]
    assert lines[1]["response"]["status_code"] == 200
    assert lines[1]["response"]["body"]["choices"][0]["message"]["content"].startswith("[null engine")

    out2 = tmp_path / "out2"
    rows = write_jsonl([{"id": 1, "title": "Cats", "body": "They purr."}], "t.jsonl")
    result = run_null(rows, "-o", out2, "--template", "Summarize {title}: {body}", "--include-prompt",
                      "--system-prompt", "Be brief.")
    assert result.exit_code == 0, result.output
    prompt = pl.read_parquet(out2 / "results.parquet")["prompt"][0]
    assert "Be brief." in prompt and "Summarize Cats: They purr." in prompt


def test_bad_rows_become_error_rows_and_nothing_is_lost(run_null, write_jsonl, tmp_path):
    rows = [
        {"id": "ok1", "prompt": "fine"},
        {"id": "empty", "prompt": "   "},
        {"id": "null", "prompt": None},
        {"id": "notstr", "prompt": 42},
        {"id": "noprompt", "text": "where is the prompt"},
        {"id": "badtemp", "prompt": "x", "temperature": "hot"},
        {"id": "badtopp", "prompt": "x", "top_p": 3},
        {"id": "badmsg", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "long", "prompt": "word " * 3000},
        "{not json",
        {"id": "ok2", "prompt": "also fine", "max_tokens": 5},
    ]
    out = tmp_path / "out"
    result = run_null(write_jsonl(rows), "-o", out, "--on-bad-line", "skip", "--max-model-len", 2048,
                      "--fail-on-row-errors")
    assert result.exit_code == EXIT_ROW_ERRORS, result.output
    ok = pl.read_parquet(out / "results.parquet")
    errors = pl.read_parquet(out / "errors.parquet")
    assert ok["id"].to_list() == ["ok1", "ok2"]
    assert len(ok) + len(errors) == len(rows)
    by_id = dict(zip(errors["id"], errors["error"]))
    assert by_id == {"empty": "empty_prompt", "null": "empty_prompt", "notstr": "bad_prompt",
                     "noprompt": "missing_prompt", "badtemp": "bad_param", "badtopp": "bad_param",
                     "badmsg": "bad_messages", "long": "prompt_too_long", "in.jsonl#9": "bad_line"}
    messages = dict(zip(errors["id"], errors["message"]))
    assert messages["badtopp"] == "top_p must be in (0, 1], got 3.0"
    assert messages["noprompt"].startswith("row has no 'prompt' or 'messages' column; keys: id, text.")
    assert "max_model_len is 2048" in messages["long"]
    assert errors.filter(pl.col("id") == "in.jsonl#9")["line"].to_list() == [10]


def test_bad_line_stops_by_default_with_file_and_line(run_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": 1, "prompt": "a"}, "{oops"])
    result = run_null(path, "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert f"Error: line is not valid JSON: Expecting property name enclosed in double quotes at column 2 ({path}:2)" in result.stderr
    assert "Hint: fix the line, or pass --on-bad-line skip" in result.stderr


def test_duplicate_ids_in_parquet_say_their_rows_and_how_often(run_null, tmp_path):
    path = tmp_path / "in.parquet"
    pl.DataFrame({"id": ["a", "b", "a", "a", "a"], "prompt": ["1", "2", "3", "4", "5"]}).write_parquet(path)
    result = run_null(path, "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert "Error: 1 ids appear more than once: 'a' (in.parquet row 0, in.parquet row 2, in.parquet row 3, " \
           "4 times in all)" in result.stderr


def test_duplicate_ids_refused_or_deduped(run_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "3"}])
    result = run_null(path, "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert f"Error: 1 ids appear more than once: 'a' ({path.name}:1, {path.name}:3)" in result.stderr  # where, to fix it
    assert not (tmp_path / "out" / "results.parquet").exists()
    assert not (tmp_path / "out").exists()  # refused before anything was written: the folder it made is gone
    result = run_null(path, "-o", tmp_path / "out", "--dedupe")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "out" / "results.parquet")["id"].to_list() == ["a", "b"]
    errors = pl.read_parquet(tmp_path / "out" / "errors.parquet")
    assert errors.select("id", "row_index", "error").rows() == [("a", 2, "duplicate_id")]


def test_rerun_resumes_and_appended_rows_are_processed(run_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": i, "prompt": f"p{i}"} for i in range(10)])
    out = tmp_path / "out"
    assert run_null(path, "-o", out, "--limit", 4).exit_code == 0
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["0", "1", "2", "3"]
    result = run_null(path, "-o", out)
    assert "rows already done               4" in result.stdout
    with open(path, "a") as handle:  # append-only input, as cron jobs produce
        handle.write(json.dumps({"id": 10, "prompt": "p10"}) + "\n")
    result = run_null(path, "-o", out)
    assert result.exit_code == 0, result.output
    assert "rows ok (this run)              1" in result.stdout
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == [str(i) for i in range(11)]


def test_changed_settings_or_rewritten_input_refuse_to_mix(run_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": i, "prompt": f"p{i}"} for i in range(3)])
    out = tmp_path / "out"
    assert run_null(path, "-o", out, "--max-tokens", 8).exit_code == 0
    result = run_null(path, "-o", out, "--max-tokens", 9)
    assert result.exit_code == EXIT_MISMATCH
    assert "max_tokens was 8, now 9" in result.stderr and "Hint: rerun with --restart" in result.stderr
    path.write_text(json.dumps({"id": 0, "prompt": "rewritten"}) + "\n")
    result = run_null(path, "-o", out, "--max-tokens", 8)
    assert result.exit_code == EXIT_MISMATCH and "changed (not only appended to)" in result.stderr
    result = run_null(path, "-o", out, "--max-tokens", 9, "--restart")
    assert result.exit_code == 0 and pl.read_parquet(out / "results.parquet")["id"].to_list() == ["0"]


def test_lock_blocks_a_second_run(run_null, write_jsonl, tmp_path):
    from qbatch.output.folder import OutputDir

    out = tmp_path / "out"
    holder = OutputDir(out).open()
    try:
        result = run_null(write_jsonl([{"prompt": "x"}]), "-o", out)
    finally:
        holder.close()
    assert result.exit_code == EXIT_LOCKED
    assert "another qbatch run is using this output folder" in result.stderr


def test_dry_run_plans_without_output(run_null, tmp_path):
    result = run_null("sample_data/mt_bench.jsonl", "--dry-run", "--chunk-tokens", 20000, "--max-tokens", 1000)
    assert result.exit_code == 0, result.output
    assert "rows valid               80" in result.stdout
    assert "chunks planned           5" in result.stdout


def test_user_mistakes_get_messages_not_tracebacks(run_null, tmp_path):
    result = run_null(tmp_path / "missing.jsonl", "-o", tmp_path / "out")
    assert result.exit_code == EXIT_INPUT
    assert result.stderr.startswith(f"Error: input file not found ({tmp_path / 'missing.jsonl'})")
    (tmp_path / "data.csv").write_text("a,b\n")
    result = run_null(tmp_path / "data.csv", "-o", tmp_path / "out")
    assert "cannot tell the file's format from its name" in result.stderr
    (tmp_path / "file").write_text("")
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    result = run_null(tmp_path / "in.jsonl", "-o", tmp_path / "file")
    assert result.exit_code == 2 and "'-o' / '--output-dir'" in result.stderr and "is a file" in result.stderr
    assert "Traceback" not in result.output


def test_keep_columns_and_sampling_defaults_from_generation_config(run_null, write_jsonl, bundled_model, tmp_path):
    import shutil

    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    model = tmp_path / "model"
    shutil.copytree(bundled_model, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    path = write_jsonl([{"id": 1, "prompt": "x", "a": 1, "b": "two", "c": [3]}])
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": str(model), "top_p": 0.5})
    base = Job.setup(spec).preparer.base_sampling
    assert base == {"temperature": 0.6, "top_p": 0.5, "top_k": 20, "max_tokens": 2048}  # the job's top_p wins
    out = tmp_path / "out"
    result = run_null(path, "-o", out, "--keep-columns", "b,c")
    assert result.exit_code == 0, result.output
    df = pl.read_parquet(out / "results.parquet")
    assert "a" not in df.columns and df["b"].to_list() == ["two"] and df["c"].to_list() == [[3]]


def test_a_conversation_the_template_rejects_fails_alone(cli, write_jsonl, bundled_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(bundled_model, model)
    strict = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must come from the user') }}"
              "{% endif %}" + (model / "chat_template.jinja").read_text())
    (model / "chat_template.jinja").write_text(strict)
    rows = [{"id": "ok", "prompt": "hi"},
            {"id": "bad", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            {"id": "ok2", "messages": [{"role": "user", "content": "hello"}]}]
    out = tmp_path / "out"
    result = cli("run", write_jsonl(rows), "-o", out, "--model", model, "--backend", "null", "--progress", "none")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(out / "results.parquet")["id"].to_list() == ["ok", "ok2"]
    errors = pl.read_parquet(out / "errors.parquet")
    assert errors.select("id", "error").rows() == [("bad", "template_error")]
    assert "the last message must come from the user" in errors["message"][0]


def test_windows_grow_so_the_engine_starts_after_the_first_few_dozen_rows(run_null, write_jsonl, tmp_path):
    out = tmp_path / "out"
    result = run_null(write_jsonl([{"id": i, "prompt": "hi"} for i in range(1600)]), "-o", out, "--max-tokens", 4)
    assert result.exit_code == 0, result.output
    chunks = json.loads((out / "stats.json").read_text())["chunks"]
    assert [c["rows"] for c in chunks] == [64, 128, 256, 1152]  # then 1024, ... up to --sort-window; the rest join
    for rows, expected in ((600, [64] + [100] * 4 + [136]), (650, [64] + [100] * 4 + [186])):
        result = run_null(write_jsonl([{"id": i, "prompt": "hi"} for i in range(rows)]), "-o", tmp_path / str(rows),
                          "--max-tokens", 4, "--sort-window", 100)
        assert [c["rows"] for c in json.loads((tmp_path / str(rows) / "stats.json").read_text())["chunks"]] == expected


def test_order_longest_first_or_input(run_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": i, "prompt": "word " * (i + 1)} for i in range(6)])

    def part_order(name: str, *flags) -> list[str]:
        out = tmp_path / name
        assert run_null(path, "-o", out, "--max-tokens", 4, *flags).exit_code == 0
        return [i for p in sorted((out / "parts").glob("part-*.parquet")) for i in pq.read_table(p)["id"].to_pylist()]

    assert part_order("sorted") == ["5", "4", "3", "2", "1", "0"]
    assert part_order("input", "--order", "input") == ["0", "1", "2", "3", "4", "5"]
    assert pl.read_parquet(tmp_path / "input" / "results.parquet")["id"].to_list() == [str(i) for i in range(6)]


def test_engines_in_processes_of_their_own_start_before_the_tokenizer_loads(run_null, write_jsonl, tmp_path,
                                                                             monkeypatch):
    """Their start overlaps the tokenizer's load and the id pre-scan; a finished job starts none."""
    from qbatch.engines.pool import EnginePool
    from qbatch.jobs import job

    events: list[str] = []

    class Noting(EnginePool):
        def start_early(self, *args):
            events.append("engines")
            return super().start_early(*args)

    load = job.load_tokenizer
    monkeypatch.setattr(job, "load_tokenizer", lambda *args: events.append("tokenizer") or load(*args))
    path, out = write_jsonl([{"id": f"r{i}", "prompt": "hi"} for i in range(3)]), tmp_path / "out"
    assert run_null(path, "-o", out, pool=Noting()).exit_code == 0
    assert events == ["engines", "tokenizer"]
    events.clear()
    assert run_null(path, "-o", out, pool=Noting()).exit_code == 0  # rerun of a completed job: nothing to do
    assert events == ["tokenizer"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--prompt-column", "question"], "Error: no row of the input has the column 'question' (--prompt-column) or "
                                      "'messages' (--messages-column); its columns: id, text, topic"),
    (["--messages-column", "turns"], "Error: no row of the input has the column 'prompt' (--prompt-column) or "
                                     "'turns' (--messages-column); its columns: id, text, topic"),
    (["--prompt-column", "text", "--id-column", "key"], "Error: no row of the input has the column 'key' "
                                                        "(--id-column); its columns: id, text, topic"),
    (["--template", "{text} in {title}"], "Error: no row of the input has the column 'title' (--template); "
                                          "its columns: id, text, topic"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_column_no_row_has_stops_the_run_before_the_engine(run_null, write_jsonl, tmp_path, flags, message, dry_run):
    path = write_jsonl([{"id": "a", "text": "one"}, {"id": "b", "text": "two", "topic": 3}])
    out = tmp_path / "out"
    result = run_null(path, "-o", out, *flags, *(["--dry-run"] if dry_run else []))
    assert result.exit_code == EXIT_USAGE, result.output
    assert message in result.stderr
    assert "Hint: " in result.stderr
    assert not (out / "manifest.json").exists()


def test_a_column_some_rows_have_runs(run_null, write_jsonl, tmp_path):
    path = write_jsonl([{"id": "a", "text": "one"}, {"id": "b", "question": "two"}])
    result = run_null(path, "-o", tmp_path / "out", "--prompt-column", "question")
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "out" / "errors.parquet")["id"].to_list() == ["a"]
