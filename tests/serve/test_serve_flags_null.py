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


def test_the_service_engines_schedule_by_priority_and_a_local_run_does_not(tmp_path):
    """Online requests are rows someone waits on: the service's engines run vLLM's priority policy, so that
    those rows go before the batch rows queued in the engine (an H100 service beside an 8,192-row batch
    answered one request in ten after 7.2 s). Not a result setting: local and --server runs resume each other."""
    from qbatch.plan import Machine, ModelFacts, resolve
    from qbatch.serve.config import ServeSettings
    from qbatch.spec import JobSpec

    machine = Machine(ModelFacts("/models/m", weights_bytes=1 << 28, max_model_len=4096), platform="cpu")

    def policy(engine: dict) -> str | None:
        return resolve(JobSpec.from_flat(engine), machine).engine.kwargs().get("scheduling_policy")

    service = ServeSettings(tmp_path, {"model": "m"})
    assert service.engine["scheduling_policy"] == "priority" and policy(service.engine) == "priority"
    assert policy({"model": "m"}) is None  # vLLM's fcfs for `qbatch run` and a Session
    assert ServeSettings(tmp_path, {"model": "m", "scheduling_policy": "fcfs"}).engine["scheduling_policy"] == "fcfs"
    assert "scheduling_policy" not in ServeSettings(tmp_path, {"model": "m", "backend": "null"}).engine
    assert "scheduling_policy" not in JobSpec.from_flat(service.engine).result_settings()
