"""A batch's lines stay OpenAI's while the service's log says what a user must not miss (issue #52): rows
that ended inside their reasoning are `finish_reason: "length"` with empty content in the output file, and a
warning with the count and the fix in the log. The null engine's answer has no `</think>`."""

from __future__ import annotations

from tests.serve.conftest import client_for, lines_of, requests_jsonl, run_to_end


def test_rows_with_no_answer_are_openai_lines_and_a_warning_in_the_log(make_service, tiny_qwen3, engine_log):
    base, _ = make_service({"model": tiny_qwen3, "backend": "null"})
    client = client_for(base)
    completions = run_to_end(client, requests_jsonl(2, url="/v1/completions", prefix="c"), endpoint="/v1/completions")
    text = lines_of(client, completions.output_file_id)[0]["response"]["body"]["choices"][0]["text"]
    assert text.startswith("[null engine")  # a completions line is not split: its text as the engine gave it
    batch = run_to_end(client, requests_jsonl(3))
    assert batch.status == "completed"
    chat = lines_of(client, batch.output_file_id)[0]["response"]["body"]["choices"][0]
    assert chat["finish_reason"] == "length" and chat["message"]["content"] == ""
    warnings = [r.getMessage() for r in engine_log.records if r.levelname == "WARNING"]
    assert (f"serve: batch {batch.id}: 3 of 3 rows ended inside their reasoning (no answer): raise --max-tokens or "
            "pass --no-thinking") in warnings
