"""Rows from text travel to their engine as text (records.PromptText) and the engine encodes them by the
driver's rule (tokens.py): the ids it sends vLLM are the driver's own, and a tokenizer that disagrees is
an error, never a row silently planned with another count."""

import pickle

import pytest

from qbatch.errors import EngineError
from qbatch.records import PromptText, Request
from qbatch.tokens import TextEncoder, encode_prompts, load_tokenizer


@pytest.fixture(scope="module")
def job(bundled_model, tmp_path_factory):
    import json

    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    rows = [{"id": "chat", "prompt": "What is 2 + 2?"},
            {"id": "messages", "messages": [{"role": "user", "content": "Hello there"}]},
            {"id": "completion", "custom_id": "completion", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": "Once upon a time"}},
            {"id": "ids", "custom_id": "ids", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": [101, 102, 103]}}]
    path = tmp_path_factory.mktemp("in") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "max_tokens": 4}))


def test_the_engine_sends_the_ids_the_tokenizer_gives_the_driver(job):
    requests, failures = job.preparer.prepare(list(job.identified_rows(set())))
    assert not failures
    by_id = {r.id: r for r in requests}
    assert {rid for rid, r in by_id.items() if isinstance(r.tokens, PromptText)} == {"chat", "messages", "completion"}
    assert by_id["ids"].tokens == [101, 102, 103]  # a row's own ids travel as they are
    wire = pickle.loads(pickle.dumps(requests))  # what a worker process or a Ray actor gets
    tokenizer = load_tokenizer(job.preparer.tokenizer.name_or_path)
    encode_prompts(wire, TextEncoder(tokenizer))
    got = {r.id: r.prompt_token_ids for r in wire}
    for rid in ("chat", "messages"):  # templated: the template wrote its special tokens
        text = by_id[rid].tokens.text
        assert got[rid] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(got[rid]) == by_id[rid].num_prompt_tokens
    assert got["completion"] == tokenizer("Once upon a time")["input_ids"]  # as is, as vLLM's /v1/completions
    assert got["ids"] == [101, 102, 103]


def test_a_count_other_than_the_drivers_stops_the_engine(bundled_model):
    tokenizer = load_tokenizer(bundled_model)
    planned = Request("r7", 0, 7, PromptText("Hello there", True, 99), {"max_tokens": 4}, None)
    with pytest.raises(EngineError, match="row r7: the engine's tokenizer gives .* where the driver's gave 99") as err:
        encode_prompts([planned], TextEncoder(tokenizer))
    assert "same model folder" in (err.value.hint or "")
    with pytest.raises(ValueError, match="not encoded yet"):
        Request("r8", 0, 8, PromptText("x", True, 1), {"max_tokens": 4}, None).prompt_token_ids


def test_a_request_pickles_whole():
    """Request and PromptText pickle by their fields' values in order (records.py): every field, kept."""
    from dataclasses import fields

    request = Request("r", 3, 9, PromptText("some text", False, 2), {"max_tokens": 4, "seed": 7}, True,
                      {"doc": "d"}, "the prompt", "adapter-a")
    assert all(getattr(request, f.name) not in (None, {}) for f in fields(Request))  # no field left at a default
    assert pickle.loads(pickle.dumps(request)) == request
    assert pickle.loads(pickle.dumps(Request("s", 0, 0, [1, 2], {"max_tokens": 1}, None))).tokens == [1, 2]


def test_the_batch_encoder_gives_the_tokenizers_own_ids(bundled_model):
    """TextEncoder takes the fast tokenizer's batch call without offsets: the ids `tokenizer(...)` gives."""
    tokenizer = load_tokenizer(bundled_model)
    texts = ["\ufeffA BOM first", "émoji 🤖 and ß", "tabs\tand\nnewlines  ", "<|im_start|>user\nhi<|im_end|>", " "]
    for special in (False, True):
        assert TextEncoder(tokenizer).ids(texts, add_special_tokens=special) == \
            tokenizer(texts, add_special_tokens=special)["input_ids"]
