"""The equivalence matrix (issue #52): a row's answer is what vLLM itself gives for the same request.

Every door (the CLI, a Session, a `qbatch serve` batch, `qbatch run --server`) and every request feature
runs through qbatch on the suite's shared engines, and the same request goes to vLLM's own
`LLM.generate` / `LLM.chat` on *the same engine* (its `LLM`, vLLM's rendering, tokenization, sampling
and detokenization): the texts must be equal. Greedy and seeded sampling, on the tiny random Qwen3 (its
think tokens) and the bundled model. Where qbatch deliberately differs, the comparison applies the rule
and names it:
- THE SPLIT: a chat-templated row with thinking on is split at its last `</think>` (output/reasoning.py);
  raw prompts and /v1/completions lines are not split (vLLM's /v1/completions splits nothing);
- ROW SEEDS: under `--seed S` a row samples with `row_seed(S, id)` (sampling.py), so equal prompts differ;
- a constraint on a thinking row needs the engine's reasoning parser (a job-level constraint gets it:
  plan/resolve.py); the reference then runs on that engine too, as vLLM would with the same settings.
Ids, sorting and chunking are qbatch's own and change no answer: results are compared by id.
LoRA adapter rows are compared in tests/engines/test_lora_engine.py (an engine of their own).
"""

from __future__ import annotations

import json
import math

import polars as pl
import pytest

from qbatch.output.reasoning import split_reasoning
from qbatch.sampling import row_seed

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "2+2=",
           "List three colors and explain why each one matters to painters in a short paragraph.",
           "Translate 'good morning' to Spanish.", "hi"]
ROWS = [{"id": f"r{i}", "prompt": p, "q": p} for i, p in enumerate(PROMPTS)]
MAX = 12
GREEDY = ("--temperature", "0", "--max-tokens", MAX, "--progress", "none")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}


def llm_of(pool, model_path: str, parser: str | None = None):
    """The vLLM `LLM` of the pool's engine for this model (and reasoning parser): the reference engine."""
    for engine in pool.engines():
        llm = getattr(engine, "llm", None)
        config = llm.llm_engine.vllm_config if llm is not None else None
        if config and config.model_config.model == model_path and \
                config.structured_outputs_config.reasoning_parser in (parser, "" if parser is None else parser):
            return llm
    raise AssertionError(f"no engine of {model_path} (parser {parser}) in the pool")


def params(**kwargs):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    constraint = kwargs.pop("constraint", None)
    if constraint is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**constraint)
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX, **kwargs})


def chat(llm, conversations, sampling, thinking: bool | None = None):
    kwargs = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    return [o.outputs for o in llm.chat(conversations, sampling, use_tqdm=False, **kwargs)]


def generate(llm, prompts, sampling):
    return [o.outputs for o in llm.generate(prompts, sampling, use_tqdm=False)]


def results(out) -> dict[str, dict]:
    return {row["id"]: row for row in pl.read_parquet(out / "results.parquet").iter_rows(named=True)}


def assert_same(ours: dict[str, dict], theirs: list, ids: list[str], *, split: bool | None):
    """qbatch's text (and reasoning) of each id equal vLLM's output, split by THE SPLIT where the row thinks."""
    assert sorted(ours) == sorted(ids), "every row answered once"
    for rid, outputs in zip(ids, theirs, strict=True):
        reasoning, text = split_reasoning(outputs[0].text, split)
        row = ours[rid]
        assert (row["reasoning"], row["text"]) == (reasoning, text), f"row {rid}: qbatch differs from vLLM"
        assert row["completion_tokens"] == len(outputs[0].token_ids), rid


def test_cli_matrix_on_the_tiny_qwen3(cli, engine_pool, tiny_qwen3, write_jsonl, tmp_path):
    data = write_jsonl(ROWS)
    ids = [r["id"] for r in ROWS]
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]

    def run(name, *args, rows=None):
        out = tmp_path / name
        result = cli("run", rows or data, "-o", out, "--model", tiny_qwen3, *GREEDY, *args)
        assert result.exit_code in (0, 7), result.output
        return results(out)

    ours = run("chat")  # the chat template, thinking on (the template's default)
    llm = llm_of(engine_pool, tiny_qwen3)
    assert_same(ours, chat(llm, convs, params()), ids, split=True)
    assert_same(run("raw", "--raw"), generate(llm, PROMPTS, params()), ids, split=None)
    assert_same(run("off", "--no-thinking"), chat(llm, convs, params(), thinking=False), ids, split=False)
    system = [[{"role": "system", "content": "Be brief."}, *c] for c in convs]
    assert_same(run("system", "--system-prompt", "Be brief."), chat(llm, system, params()), ids, split=True)
    templated = [[{"role": "user", "content": f"Q: {p}\nA:"}] for p in PROMPTS]
    assert_same(run("template", "--template", "Q: {q}\nA:"), chat(llm, templated, params()), ids, split=True)
    messages = write_jsonl([{"id": r["id"], "messages": s} for r, s in zip(ROWS, system, strict=True)], "m.jsonl")
    assert_same(run("messages", rows=messages), chat(llm, system, params()), ids, split=True)

    # per-row max_tokens and stop strings
    per_row = write_jsonl([{**r, "max_tokens": 3 + i} for i, r in enumerate(ROWS)], "per_row.jsonl")
    theirs = [chat(llm, [c], params(max_tokens=3 + i))[0] for i, c in enumerate(convs)]
    assert_same(run("per_row", rows=per_row), theirs, ids, split=True)
    stop = chat(llm, convs[:1], params())[0][0].text[3:6]  # a string the greedy output holds: a stop really hit
    assert_same(run("stop", "--stop", stop), chat(llm, convs, params(stop=[stop])), ids, split=True)

    # ROW SEEDS: sampled, n = 2, each row with its own seed from --seed
    run("seeded", "--seed", "7", "--temperature", "0.9", "--n", "2")
    ours = pl.read_parquet(tmp_path / "seeded" / "results.parquet")
    for rid, conv in zip(ids, convs, strict=True):
        theirs = chat(llm, [conv], params(temperature=0.9, n=2, seed=row_seed(7, rid)))[0]
        rows = ours.filter(pl.col("id") == rid).sort("sample_index")
        assert [split_reasoning(o.text, True) for o in theirs] == list(zip(rows["reasoning"], rows["text"], strict=True))

    # logprobs: the same tokens with the same logprobs
    ours = run("logprobs", "--raw", "--logprobs", "--top-logprobs", "2")
    for rid, outputs in zip(ids, generate(llm, PROMPTS, params(logprobs=2)), strict=True):
        got = ours[rid]["logprobs"]
        assert [t["token"] for t in got] == [step[tok].decoded_token for tok, step in
                                             zip(outputs[0].token_ids, outputs[0].logprobs, strict=True)]
        assert all(math.isclose(t["logprob"], step[tok].logprob, abs_tol=1e-4) for t, tok, step in
                   zip(got, outputs[0].token_ids, outputs[0].logprobs, strict=True))

    # constraints on raw prompts: no reasoning parser (a --raw job gets none), held from the first token
    for flag, value, constraint in (("--choice", "yes,no", {"choice": ["yes", "no"]}),
                                    ("--regex", "[a-z]{2,5}", {"regex": "[a-z]{2,5}"}),
                                    ("--json-schema", json.dumps(SCHEMA), {"json": SCHEMA})):
        ours = run(f"raw{flag}", "--raw", flag, value)
        assert_same(ours, generate(llm, PROMPTS, params(constraint=constraint)), ids, split=None)
        assert all(row["parsed"] is not None or row["flag"] == "cut" for row in ours.values()), flag

    # OpenAI lines: /v1/completions (not split) with logit_bias, chat lines with response_format and
    # chat_template_kwargs (a row-level constraint on an engine without a parser holds from the first token)
    token = llm.get_tokenizer().encode("yes", add_special_tokens=False)[0]
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": PROMPTS[2], "max_tokens": MAX, "temperature": 0, "logit_bias": {str(token): 5}}},
             {"custom_id": "j", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": convs[0], "max_tokens": MAX, "temperature": 0,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}},
             {"custom_id": "k", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": convs[1], "max_tokens": MAX, "temperature": 0,
                       "chat_template_kwargs": {"enable_thinking": False}}}]
    ours = run("openai", rows=write_jsonl(lines, "openai.jsonl"))
    assert_same({"c": ours["c"]}, generate(llm, [PROMPTS[2]], params(logit_bias={token: 5})), ["c"], split=None)
    assert_same({"j": ours["j"]}, chat(llm, [convs[0]], params(constraint={"json": SCHEMA})), ["j"], split=None)
    assert_same({"k": ours["k"]}, chat(llm, [convs[1]], params(), thinking=False), ["k"], split=False)


def test_constraints_after_the_reasoning_match_vllm_with_its_parser(cli, engine_pool, tiny_qwen3, write_jsonl,
                                                                    tmp_path):
    """A job-level constraint on chat rows: the engine gets the model's reasoning parser, which holds the
    constraint until `</think>` (thinking on) or applies it at once (thinking off: the prompt closed the
    reasoning); vLLM's own LLM on that engine answers the same. A thinking budget needs the parser too."""
    data = write_jsonl(ROWS)
    ids = [r["id"] for r in ROWS]
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    for name, args, constraint, thinking in (
            ("json", ("--json-schema", json.dumps(SCHEMA)), {"json": SCHEMA}, None),
            ("choice-off", ("--choice", "yes,no", "--no-thinking"), {"choice": ["yes", "no"]}, False)):
        out = tmp_path / name
        result = cli("run", data, "-o", out, "--model", tiny_qwen3, *GREEDY, *args)
        assert result.exit_code in (0, 7), result.output
        llm = llm_of(engine_pool, tiny_qwen3, "qwen3")
        assert_same(results(out), chat(llm, convs, params(constraint=constraint), thinking=thinking), ids,
                    split=thinking is not False)
    off = results(tmp_path / "choice-off")
    assert all(row["parsed"] in ("yes", "no") for row in off.values())  # thinking off: constrained at once
    out = tmp_path / "budget"
    result = cli("run", data, "-o", out, "--model", tiny_qwen3, *GREEDY, "--thinking-token-budget", "3")
    assert result.exit_code in (0, 7), result.output
    assert_same(results(out), chat(llm, convs, params(thinking_token_budget=3)), ids, split=True)


def test_session_service_and_server_doors_give_vllms_answers(cli, engine_pool, tiny_qwen3, write_jsonl, tmp_path):
    """The Python door, a `qbatch serve` batch and `qbatch run --server` on the same warm engine."""
    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import serve_in_thread
    from qbatch.session import Session
    from tests.serve.conftest import client_for, free_port, lines_of, run_to_end, wait_until

    ids = [r["id"] for r in ROWS]
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    with Session(tiny_qwen3, pool=engine_pool) as session:
        ours = session.run(ROWS, temperature=0, max_tokens=MAX).results
    llm = llm_of(engine_pool, tiny_qwen3)
    assert_same({r["id"]: r for r in ours.iter_rows(named=True)}, chat(llm, convs, params()), ids, split=True)

    port = free_port()
    service, server, thread = serve_in_thread(
        ServeSettings(tmp_path / "data", {"model": tiny_qwen3}, {"progress": "none"}, port=port), pool=engine_pool)
    try:
        wait_until(lambda: server.started, 60)
        wait_until(lambda: service.worker.ready.is_set() or service.worker.failed, 300)
        lines = [{"custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": c, "max_tokens": MAX, "temperature": 0}} for r, c in zip(ROWS, convs, strict=True)]
        client = client_for(f"http://127.0.0.1:{port}/v1")
        batch = run_to_end(client, "".join(json.dumps(line) + "\n" for line in lines).encode(), timeout_s=300)
        answers = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]
                   for line in lines_of(client, batch.output_file_id)}
        for rid, outputs in zip(ids, chat(llm, convs, params()), strict=True):
            reasoning, text = split_reasoning(outputs[0].text, True)
            assert (answers[rid]["content"], answers[rid].get("reasoning")) == (text, reasoning), rid

        out = tmp_path / "server"
        result = cli("run", write_jsonl(ROWS), "-o", out, "--model", tiny_qwen3, *GREEDY,
                     "--server", f"http://127.0.0.1:{port}")
        assert result.exit_code in (0, 7), result.output
        assert_same(results(out), chat(llm, convs, params()), ids, split=True)
    finally:
        server.should_exit = True
        service.worker.stop()
        thread.join(10)
        service.worker.join(30)
        service.close()


def test_the_bundled_model_raw_and_chat(cli, engine_pool, bundled_model, write_jsonl, tmp_path):
    """A model without think tokens: nothing is split, raw or templated."""
    data = write_jsonl(ROWS)
    ids = [r["id"] for r in ROWS]
    for name, args in (("chat", ()), ("raw", ("--raw",))):
        out = tmp_path / name
        assert cli("run", data, "-o", out, "--model", bundled_model, *GREEDY, *args).exit_code == 0
        llm = llm_of(engine_pool, bundled_model)
        theirs = (generate(llm, PROMPTS, params()) if args else
                  chat(llm, [[{"role": "user", "content": p}] for p in PROMPTS], params()))
        assert_same(results(out), theirs, ids, split=None)
