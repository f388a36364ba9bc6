"""`qbatch serve` in a subprocess on the real engine (the tiny random Qwen3): the SDK end to end, the online
route answering as the batch line did (and beside a running batch), a `qbatch run --server` job, cancel mid-run, and kill -9 mid-batch then a restart: every custom_id exactly once in the output or
error file."""

from __future__ import annotations

import collections
import json
import os
import re
import signal

import subprocess
import sys

import httpx
import polars as pl
import pytest

from tests.serve.conftest import ROOT, client_for, lines_of, requests_jsonl, wait_until

pytestmark = pytest.mark.slow
START_S = 600.0
# Small chunks, few sequences at a time: many parts per batch, written one after another, so a kill or
# a cancel lands mid-batch (with every row in the engine at once, an idle machine finished all the
# chunks of a batch within one poll).
FLAGS = ("--max-tokens", "24", "--chunk-tokens", "400", "--max-num-seqs", "8", "--progress", "none")


def _healthy(base: str, proc) -> bool:
    """The service answers ok; a service that exited or whose engines failed to start fails the test
    at once (its log is in the test's folder) instead of after START_S."""
    assert proc.poll() is None, f"qbatch serve exited with {proc.returncode} while starting"
    try:
        status = httpx.get(base + "/health", timeout=5).json().get("status")
    except httpx.HTTPError:
        return False
    assert status != "error", "qbatch serve's engines did not start"
    return status == "ok"


def _mid_batch(client, batch_id: str):
    batch = client.batches.retrieve(batch_id)
    done = batch.request_counts.completed + batch.request_counts.failed
    return batch if 0 < done < batch.request_counts.total else None


def test_end_to_end_cancel_and_kill_9_restart_exactly_once(serve_process, tiny_qwen3, engine_pool, tmp_path):
    from transformers import AutoTokenizer

    engine_pool.close_all()  # the service starts an engine of its own: this process's go first (memory)
    data_dir = tmp_path / "data"
    base, proc = serve_process("--model", tiny_qwen3, *FLAGS, data_dir=data_dir)
    wait_until(lambda: _healthy(base, proc), START_S, 1.0)
    client = client_for(base + "/v1")

    # end to end, thinking switch and per-request sampling in the lines; logit_bias reaches the engine
    token = AutoTokenizer.from_pretrained(tiny_qwen3).encode("yes", add_special_tokens=False)[0]
    biased = {"custom_id": "biased", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "say no"}], "max_completion_tokens": 4,
                       "temperature": 0, "ignore_eos": True, "logit_bias": {str(token): 100},
                       "chat_template_kwargs": {"enable_thinking": False}}}
    data = requests_jsonl(4, max_tokens=8) + (json.dumps(biased) + "\n").encode()
    file = client.files.create(file=("e2e.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 300, 0.5)
    output = {line.pop("custom_id"): line["response"]["body"] for line in lines_of(client, done.output_file_id)}
    assert sorted(output) == ["biased", *(f"req-{i}" for i in range(4))]
    assert all(body["usage"]["completion_tokens"] <= 8 for body in output.values())
    assert all(isinstance(body["choices"][0]["message"]["content"], str) for body in output.values())
    assert output["biased"]["choices"][0]["message"]["content"] == "yes" * 4
    assert done.usage.output_tokens == sum(body["usage"]["completion_tokens"] for body in output.values())
    # the online route on the same warm engine: the same request answers as its batch line did
    body = dict(biased["body"])
    extra = {key: body.pop(key) for key in ("ignore_eos", "chat_template_kwargs")}  # vLLM's: not the SDK's keys
    online = client.chat.completions.create(model=done.model, **body, extra_body=extra).model_dump()
    assert online["choices"][0]["message"]["content"] == output["biased"]["choices"][0]["message"]["content"]
    assert online["usage"]["completion_tokens"] == output["biased"]["usage"]["completion_tokens"]
    thinks = {"model": done.model, "messages": [{"role": "user", "content": "say 0"}], "max_completion_tokens": 8,
              "temperature": 0}
    again = [client.chat.completions.create(**thinks).choices[0].message for _ in range(2)]
    assert again[0].content == again[1].content and again[0].reasoning_content == again[1].reasoning_content
    # vLLM's own output goes to the data folder's engine log, the service's own lines to its stderr
    assert "(EngineCore" in (data_dir / "engine.log").read_text()
    assert "(EngineCore" not in (tmp_path / "serve-0.log").read_text()

    # `qbatch run --server`: a job handed to the running service, on its warm engine, into the client's folder
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"id": f"s{i}", "prompt": f"count {i}"}) + "\n"
                                                for i in range(3)))
    handed = subprocess.run([sys.executable, "-m", "qbatch.cli", "run", "few.jsonl", "-o", "out/server",
                             "--max-tokens", "6", "--server", base], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert handed.returncode == 0, handed.stderr
    assert "qbatch run completed" in handed.stdout and "out/server/results.parquet (3 rows)" in handed.stdout
    results = pl.read_parquet(tmp_path / "out/server/results.parquet")
    assert sorted(results["id"]) == ["s0", "s1", "s2"] and (results["completion_tokens"] <= 6).all()
    # vLLM's own output goes to the service's engine log: none of its lines (`INFO 05-01 12:00:00 [...]`) here
    assert "(EngineCore" not in handed.stderr and not re.search(r"^(INFO|WARNING|DEBUG) \d\d-\d\d ", handed.stderr, re.M)

    # cancel mid-run: the requests done so far are in the output file
    file = client.files.create(file=("cancel.jsonl", requests_jsonl(120, prefix="c", max_tokens=24)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: _mid_batch(client, batch.id), 300, 0.05)
    # an online request fed in between the batch's slices, ahead of its rows queued in the engine (vLLM's
    # priority policy, the service's default; n > 1 under it crashed some vLLM releases' engines)
    beside = client.chat.completions.create(**{**thinks, "temperature": 0.8}, n=2, seed=1)
    assert len(beside.choices) == 2 and all(c.finish_reason in ("stop", "length") for c in beside.choices)
    assert beside.usage.completion_tokens <= 16
    plans = [json.loads(m.read_text())["plan"]["llm_args"] for m in data_dir.rglob("manifest.json")]
    assert plans and all(plan["scheduling_policy"]["value"] == "priority" for plan in plans)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    cancelled = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b, 300, 0.5)
    kept = lines_of(client, cancelled.output_file_id)
    assert 0 < len(kept) < 120 and cancelled.request_counts.completed == len(kept)
    not_run = [line["custom_id"] for line in lines_of(client, cancelled.error_file_id)
               if line["error"]["code"] == "batch_cancelled"]  # the rest: each request in one file
    assert sorted(not_run + [line["custom_id"] for line in kept]) == sorted(f"c-{i}" for i in range(120))
    assert cancelled.request_counts.failed == 120 - len(kept)

    # kill -9 mid-batch, a second batch queued behind it; restart: both finish, each request once
    big = client.files.create(file=("big.jsonl", requests_jsonl(120, prefix="k", max_tokens=24)), purpose="batch")
    running = client.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="24h")
    small = client.files.create(file=("q.jsonl", requests_jsonl(5, prefix="q")), purpose="batch")
    queued = client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: _mid_batch(client, running.id), 300, 0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)

    base, proc = serve_process("--model", tiny_qwen3, *FLAGS, data_dir=data_dir)
    wait_until(lambda: _healthy(base, proc), START_S, 1.0)
    client = client_for(base + "/v1")
    assert client.batches.retrieve(queued.id).status == "in_progress"  # still queued
    for batch_id, prefix, total in ((running.id, "k", 120), (queued.id, "q", 5)):
        final = wait_until(lambda: (b := client.batches.retrieve(batch_id)).status == "completed" and b, 600, 0.5)
        ids = [line["custom_id"] for line in lines_of(client, final.output_file_id) + lines_of(client, final.error_file_id)]
        assert collections.Counter(ids) == collections.Counter(f"{prefix}-{i}" for i in range(total))
        assert final.request_counts.completed + final.request_counts.failed == total
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0
