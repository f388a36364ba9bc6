"""`qbatch serve`'s online routes (/v1/chat/completions, /v1/completions) through the openai SDK (sync,
async, streaming) and LangChain's ChatOpenAI, on null stand-in engines with a thinking model's tokenizer
(tiny_qwen3): OpenAI's objects, the reasoning apart, online requests gathered beside a running batch,
and bad input answered with OpenAI's error object while the service keeps serving."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from qbatch.engines.base import NullEngine
from qbatch.engines.pool import EnginePool
from qbatch.records import Completion, Sample
from tests.serve.conftest import client_for, lines_of, requests_jsonl, run_to_end, wait_until


class EchoEngine(NullEngine):
    """A thinking model's stand-in: each answer names its request's seed (so every answer can be matched to
    its request), thinks when the row thinks, answers JSON under a constraint; `delay_s` a row."""

    def __init__(self, delay_s: float = 0.0):
        super().__init__()
        self.delay_s = delay_s

    def run(self, chunks):
        for chunk in chunks:
            for request in chunk.requests if chunk is not None else []:
                if self.delay_s:
                    time.sleep(self.delay_s)
                    yield None
                yield chunk, [self._complete(request)]

    @staticmethod
    def _complete(r) -> Completion:
        seed = r.sampling.get("seed")
        if "structured_outputs" in r.sampling:
            text = json.dumps({"answer": f"seed {seed}"})
        else:
            text = (f"<think>thought {seed}</think>" if r.thinking else "") + f"answer {seed}"
        more = [Sample(f"{text} #{i}", "stop", 3) for i in range(1, r.sampling.get("n", 1))]
        return Completion(r, text, "stop", 3, more_samples=more)


@pytest.fixture
def echo_service(make_service, tiny_qwen3):
    def make(delay_s: float = 0.0, **settings):
        engine = EchoEngine(delay_s)
        base_url, service = make_service(engine={"model": tiny_qwen3, "backend": "null"},
                                         pool=EnginePool(start=lambda *args, **kwargs: engine), **settings)
        return base_url, service, client_for(base_url, settings.get("api_key", "unused")).models.list().data[0].id
    return make


def test_chat_and_completions_through_the_sdk(echo_service):
    base_url, _, model = echo_service()
    client = client_for(base_url)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], seed=7,
                                          max_completion_tokens=5)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == model
    message = chat.choices[0].message
    assert (message.role, message.content, chat.choices[0].finish_reason) == ("assistant", "answer 7", "stop")
    assert message.reasoning_content == "thought 7"  # vLLM's name, beside the answer
    assert chat.usage.completion_tokens == 3 and chat.usage.total_tokens == chat.usage.prompt_tokens + 3

    off = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], seed=8,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (off.choices[0].message.content, getattr(off.choices[0].message, "reasoning_content", None)) == (
        "answer 8", None)
    assert off.usage.prompt_tokens > chat.usage.prompt_tokens  # the template's empty think block

    two = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2, seed=1)
    assert [(c.index, c.message.content) for c in two.choices] == [(0, "answer 1"), (1, "answer 1 #1")]

    text = client.completions.create(model=model, prompt="<think>raw", max_tokens=4, seed=3, stop=["\n"])
    assert text.object == "text_completion" and text.choices[0].text == "answer 3"  # a raw prompt never thinks


def test_the_async_sdk_and_streaming(echo_service):
    base_url, _, model = echo_service()

    async def many():
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"q{i}"}], seed=i) for i in range(8)))
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                      seed=5, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await client.close()
        return replies, chunks

    replies, chunks = asyncio.run(many())
    assert [r.choices[0].message.content for r in replies] == [f"answer {i}" for i in range(8)]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].usage is None
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "answer 5"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "thought 5"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert len({c.id for c in chunks}) == 1

    raw = httpx.post(f"{base_url}/completions", json={"model": model, "prompt": "x", "stream": True}, timeout=30)
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"
    assert "usage" not in json.loads(events[0].removeprefix("data: "))  # no include_usage: no usage key


def test_an_online_answer_is_the_batch_line_answer(echo_service):
    base_url, _, model = echo_service()
    client = client_for(base_url)
    body = {"model": model, "messages": [{"role": "user", "content": "same"}], "seed": 4, "temperature": 0}
    line = {"custom_id": "same", "method": "POST", "url": "/v1/chat/completions", "body": body}
    batch = run_to_end(client, (json.dumps(line) + "\n").encode())
    [out] = lines_of(client, batch.output_file_id)
    online = client.chat.completions.create(**body).model_dump()
    batch_body = out["response"]["body"]
    assert [c["message"]["content"] for c in online["choices"]] == [c["message"]["content"] for c in batch_body["choices"]]
    assert online["choices"][0]["message"]["reasoning"] == batch_body["choices"][0]["message"]["reasoning"]
    assert online["usage"] == {**batch_body["usage"], "completion_tokens_details": None, "prompt_tokens_details": None}


def test_langchain_chat_openai(echo_service):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    base_url, _, model = echo_service()
    llm = langchain_openai.ChatOpenAI(model=model, base_url=base_url, api_key="unused", max_retries=0, seed=2,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert llm.invoke("hello").content == "answer 2"
    assert [m.content for m in llm.batch(["a", "b", "c"], config={"max_concurrency": 3})] == ["answer 2"] * 3
    assert "".join(chunk.content for chunk in llm.stream("hello")) == "answer 2"

    class Verdict(BaseModel):
        answer: str

    assert llm.with_structured_output(Verdict).invoke("judge") == Verdict(answer="seed 2")


def test_64_clients_while_a_batch_runs_each_get_their_own_answer(echo_service):
    base_url, service, model = echo_service(delay_s=0.005)
    client = client_for(base_url)
    file = client.files.create(file=("big.jsonl", requests_jsonl(400, prefix="b")), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0, 60, every_s=0.01)
    since = time.monotonic()
    answers: dict[int, str] = {}
    latencies: list[float] = []

    def ask(i: int) -> None:
        started = time.monotonic()
        reply = client_for(base_url).chat.completions.create(model=model, seed=i,
                                                             messages=[{"role": "user", "content": f"q{i}"}])
        latencies.append(time.monotonic() - started)
        answers[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {i: f"answer {i}" for i in range(64)}  # each answer to its request, none lost or doubled
    answered_s = time.monotonic() - since
    done = wait_until(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 120)
    batch_s = time.monotonic() - since
    assert done.request_counts.completed == 400 and len(lines_of(client, done.output_file_id)) == 400
    stats = service.app.state.online.feeder.stats
    assert stats.requests == 64 and stats.in_runs >= 1 and stats.gathers < 64  # gathered, beside the batch
    assert answered_s < batch_s  # online first: the clients did not wait for the batch's end


def test_bad_input_gets_an_openai_error_and_the_service_keeps_serving(echo_service):
    base_url, _, model = echo_service()
    client = client_for(base_url)
    chat = f"{base_url}/chat/completions"
    cases = [
        (httpx.post(chat, content=b"{not json", headers={"content-type": "application/json"}), 400, None),
        (httpx.post(chat, json={"model": model}), 400, None),
        (httpx.post(chat, json={"model": model, "messages": [{"role": "user", "content": "x"}], "n": "two"}), 400, None),
        (httpx.post(chat, json={"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}), 404,
         "model_not_found"),
        (httpx.post(chat, json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                "tools": [{"type": "function", "function": {"name": "f"}}]}), 400,
         "unsupported_parameter"),
        (httpx.post(chat, json={"model": model, "messages": [{"role": "user", "content": "x"}], "n": 0}), 400,
         "bad_param"),
        (httpx.post(chat, json={"model": model, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}), 413,
         "request_too_large"),
        (httpx.post(f"{base_url}/completions", json={"model": model, "prompt": ""}), 400, "empty_prompt"),
    ]
    for response, status, code in cases:
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (status, code), error
        assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    with httpx.stream("POST", chat, json={"model": model, "messages": [{"role": "user", "content": "x"}],
                                          "stream": True}, timeout=30) as cut:
        next(cut.iter_lines())  # the client goes away after the first event
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "still"}], seed=9)
    assert reply.choices[0].message.content == "answer 9"


def test_online_routes_take_the_api_key_as_the_batch_routes(echo_service):
    base_url, _, model = echo_service(api_key="sesame")
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        client_for(base_url).chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    reply = client_for(base_url, "sesame").chat.completions.create(model=model, seed=1,
                                                                   messages=[{"role": "user", "content": "x"}])
    assert reply.choices[0].message.content == "answer 1"


def test_a_remote_session_and_qbatch_chat_run_on_the_service(echo_service):
    from qbatch import Session
    from qbatch.errors import SpecError
    from qbatch.session.langchain import QbatchChat
    from qbatch.session.remote import RemoteSession

    base_url, _, model = echo_service()
    remote = Session(server=base_url)
    assert isinstance(remote, RemoteSession) and remote.engine_settings["model"] == model
    with pytest.raises(SpecError, match="the service runs"):
        Session("another-model", server=base_url)
    assert remote.generate(["a", "b"], seed=3, thinking=False) == ["answer 3", "answer 3"]
    [reply] = remote.replies("messages", [[{"role": "user", "content": "why"}]], seed=4)
    assert (reply.text, reply.reasoning, reply.finish_reason, reply.completion_tokens) == ("answer 4", "thought 4",
                                                                                           "stop", 3)
    [failed] = remote.replies("prompt", [""])
    assert failed.error == "empty_prompt" and failed.text is None
    assert QbatchChat(session=remote).invoke("hello", seed=5).content == "answer 5"


def test_online_requests_in_a_cancelled_batch_run_are_answered_after_it(echo_service):
    base_url, service, model = echo_service(delay_s=0.01)
    client = client_for(base_url)
    file = client.files.create(file=("big.jsonl", requests_jsonl(2000, prefix="c")), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed > 0, 60, every_s=0.01)
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = client_for(base_url).chat.completions.create(model=model, seed=i, n=3,
                                                             messages=[{"role": "user", "content": f"q{i}"}])
        answers[i] = reply.choices[2].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    wait_until(lambda: service.app.state.online.feeder.stats.in_runs > 0, 30, every_s=0.005)
    client.batches.cancel(batch.id)  # the run stops with online rows in its stream: they go on without it
    for thread in threads:
        thread.join(60)
    assert answers == {i: f"answer {i} #2" for i in range(16)}
    assert wait_until(lambda: client.batches.retrieve(batch.id).status == "cancelled" or None, 60)


def test_embeddings_online_as_a_batch_line_gives_them(make_service, tiny_qwen3):
    base_url, _ = make_service(engine={"model": tiny_qwen3, "backend": "null"})
    client = client_for(base_url)
    model = client.models.list().data[0].id
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a text"}}
    batch = run_to_end(client, (json.dumps(line) + "\n").encode(), endpoint="/v1/embeddings")
    [out] = lines_of(client, batch.output_file_id)
    online = client.embeddings.create(model=model, input=["a text", "another"])  # base64, as the SDK asks
    assert [item.index for item in online.data] == [0, 1] and online.object == "list"
    assert online.data[0].embedding == pytest.approx(out["response"]["body"]["data"][0]["embedding"], rel=1e-6)
    another = client.embeddings.create(model=model, input="another", encoding_format="float").usage.prompt_tokens
    assert online.usage.prompt_tokens == out["response"]["body"]["usage"]["prompt_tokens"] + another
    floats = httpx.post(f"{base_url}/embeddings", json={"model": model, "input": "a text"}, timeout=30).json()
    assert floats["data"][0]["embedding"] == out["response"]["body"]["data"][0]["embedding"]
    empty = httpx.post(f"{base_url}/embeddings", json={"model": model, "input": ["ok", ""]}, timeout=30)
    assert empty.status_code == 400 and empty.json()["error"]["message"].startswith("input[1]: ")
