"""OpenAI's online routes on the warm engines: `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`.

A request's body becomes the batch line `{"custom_id", "url", "body"}` and is prepared by the same
Preparer as a batch's lines (inputs/prepare.py): the same keys, checks, chat template, thinking rule
(a chat-templated row of a thinking model thinks unless `chat_template_kwargs.enable_thinking` is false;
a /v1/completions prompt is sent as is and never split) and sampling. Its Request is gathered with
the others (gather.py) onto the engines batches run on, and its answer is the body a batch's output
line holds for that request (output/assemble.py), with the reasoning also under vLLM's
`reasoning_content`. An embeddings request's inputs are rows of the `/v1/embeddings` batches' job, on
their engine (with a feeder of its own). Streaming is OpenAI's server-sent events; the engine reports
a row once it has finished, so a stream sends the role at once, then the whole answer as one delta,
then the finish, the usage chunk (`stream_options.include_usage`) and `[DONE]`.

Authentication is the app's (its middleware: `--api-key`, loopback by default); errors are OpenAI's
error objects (app.py's handlers).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from qbatch.engines.pool import EnginePool
from qbatch.errors import EngineError, QbatchError
from qbatch.inputs.prepare import Preparer
from qbatch.inputs.validate import EMBEDDINGS_URL
from qbatch.jobs.job import Job
from qbatch.records import Completion, Row
from qbatch.serve.config import ServeSettings
from qbatch.serve.gather import Feeder, SharedPool, Ticket
from qbatch.serve.objects import ApiError, client_text
from qbatch.serve.openai_models import (
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChunkChoice, CompletionRequest, EmbeddingItem,
    EmbeddingList, EmbeddingRequest, EmbeddingUsage, TextChoice, TextCompletion, TextCompletionChunk, Usage,
)
from qbatch.serve.worker import BATCH_INPUT, BatchWorker

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MAX_BODY_BYTES = 8 * 1024 * 1024  # an online request's body: prompts beyond this belong in a batch file
STREAM_ONLY = ("stream", "stream_options")  # how the answer is sent, not what it is: not the batch line's


def install(app: FastAPI, settings: ServeSettings, worker: BatchWorker) -> None:
    """The online routes on `app`, their requests fed to `worker`'s engines beside its batches."""
    feeders = {task: Feeder(worker.session.pool, ready=worker.ready, failed=lambda: worker.failed)
               for task in ("generate", "embed")}
    # runs on the service's engines feed online rows; SharedPool wraps the pool, passing through what it does not change
    worker.session.pool = cast(EnginePool, SharedPool(worker.session.pool, feeders))
    online = Online(settings, worker, feeders)
    app.state.online = online

    @app.post(CHAT_URL, dependencies=[Depends(within_limit)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await online.answer(CHAT_URL, body.model_dump(exclude_unset=True), request)

    @app.post(COMPLETIONS_URL, dependencies=[Depends(within_limit)])
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await online.answer(COMPLETIONS_URL, body.model_dump(exclude_unset=True), request)

    @app.post(EMBEDDINGS_URL, dependencies=[Depends(within_limit)])
    async def embeddings(body: EmbeddingRequest) -> EmbeddingList:
        return await online.embed(body.model_dump(exclude_unset=True))


def within_limit(request: Request) -> None:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {int(length):,} bytes; an online request takes at most "
                            f"{MAX_BODY_BYTES:,} (send larger work as a batch: POST /v1/files, /v1/batches)",
                       code="request_too_large")


class Online:
    """Requests in (prepared as batch lines), answers out (a batch output line's body)."""

    def __init__(self, settings: ServeSettings, worker: BatchWorker, feeders: dict[str, Feeder]):
        self.settings, self.worker, self.feeders = settings, worker, feeders
        self.feeder = feeders["generate"]
        self._jobs: dict[str, Job] = {}  # by task: the batches' job settings on the service's engine
        self._prepare_lock = threading.Lock()  # one tokenizer, shared: one request prepared at a time
        lora = settings.engine.get("lora") or {}
        self.models = {settings.model, str(settings.engine["model"]), *lora}

    async def answer(self, url: str, body: dict[str, Any], request: Request) -> Any:
        self._check(body)
        stream = bool(body.get("stream"))
        usage_chunk = bool((body.get("stream_options") or {}).get("include_usage"))
        line_body = {key: value for key, value in body.items() if key not in STREAM_ONLY}
        rid = secrets.token_hex(12)
        ticket = Ticket([await run_in_threadpool(self._prepare, url, line_body, rid)])
        self.feeder.submit(ticket)
        created = int(time.time())
        if not stream:
            return self._response(url, await self._wait(ticket), created)
        events = _chat_events if url == CHAT_URL else _text_events
        return StreamingResponse(self._stream(events, ticket, url, rid, created, usage_chunk),
                                 media_type="text/event-stream")

    async def embed(self, body: dict[str, Any]) -> EmbeddingList:
        """OpenAI's embeddings: each input a row of the service's embedding job (`/v1/embeddings` batches'),
        on the embedding engine those batches use (started by the first of them or of these)."""
        self._check(body)
        as_base64 = body.pop("encoding_format", None) == "base64"  # the openai SDK's default: decoded by it
        given = body["input"]
        inputs = [given] if isinstance(given, str) or (given and all(type(t) is int for t in given)) else given
        if not inputs:
            raise ApiError(400, "input is empty", param="input", code="empty_prompt")
        rid = secrets.token_hex(12)
        bodies = [{**body, "input": item} for item in inputs]
        ticket = Ticket(await run_in_threadpool(self._prepare_all, EMBEDDINGS_URL, bodies, rid))
        self.feeders["embed"].submit(ticket)
        return embedding_list(await self._wait(ticket), self._jobs["embed"].spec.embed, self.settings.model,
                              as_base64=as_base64)

    def _check(self, body: dict[str, Any]) -> None:
        if body.get("model") not in self.models:
            raise ApiError(404, f"the model {body.get('model')!r} does not exist; this service runs "
                                f"{self.settings.model!r} (GET /v1/models lists it and its adapters)",
                           param="model", code="model_not_found")
        if self.worker.failed:
            raise ApiError(503, f"the service's engines did not start ({self.worker.failed})", kind="server_error",
                           code="engines_failed")

    # -- preparing -----------------------------------------------------------------
    def _prepare(self, url: str, body: dict[str, Any], rid: str) -> Any:
        return self._prepare_all(url, [body], rid)[0]

    def _prepare_all(self, url: str, bodies: list[dict[str, Any]], rid: str) -> list[Any]:
        """The Requests of a request's bodies (an embeddings request's inputs, else one), in order; the first
        that cannot run is a 400 (with its input's index where there are several)."""
        ids = [rid] if len(bodies) == 1 else [f"{rid}-{i}" for i in range(len(bodies))]
        rows = [(Row("online", 0, i, None, {"custom_id": ids[i], "method": "POST", "url": url, "body": body}), ids[i])
                for i, body in enumerate(bodies)]
        with self._prepare_lock:
            requests, failures = self._preparer_now(url).prepare(rows)
        if failures:
            failure = min(failures, key=lambda f: f.row_index)
            where = f"input[{failure.row_index}]: " if len(bodies) > 1 else ""
            raise ApiError(400, where + client_text(failure.message), code=failure.error)
        for request in requests:
            request.extra = {"url": url}  # what the answer's shape needs; the prompt is the client's own
        return sorted(requests, key=lambda r: r.row_index)

    def _preparer_now(self, url: str) -> Preparer:
        """The batches' Preparer for `url` (their job settings, the service's engine), loaded by the first
        request; its engine's configuration is what the feeder runs online rows on until a run names one."""
        task = "embed" if url == EMBEDDINGS_URL else "generate"
        if task not in self._jobs:
            from qbatch.spec import JobSpec

            folder = self.settings.data_dir / "online"
            folder.mkdir(exist_ok=True)
            stand_in = folder / f"{task}.jsonl"  # a job needs an input: the preparer never reads it
            body = {"input": "-"} if task == "embed" else {"messages": [{"role": "user", "content": "-"}]}
            stand_in.write_text(json.dumps({"custom_id": "0", "url": url, "body": body}) + "\n")
            values = {**self.settings.engine, **self.settings.job, **BATCH_INPUT, "inputs": [str(stand_in)],
                      "output_dir": str(folder / "out"), **({"task": "embed"} if task == "embed" else {})}
            try:
                job = Job.setup(JobSpec.from_flat(values, source="qbatch serve"))
            except QbatchError as exc:
                raise ApiError(503, f"the service cannot prepare requests: {client_text(exc.message)}",
                               kind="server_error") from None
            self.feeders[task].config = self.feeders[task].config or job.plan.engine
            self._jobs[task] = job
        return self._jobs[task].preparer

    # -- answering -------------------------------------------------------------------
    async def _wait(self, ticket: Ticket) -> list[Completion]:
        try:
            completions: list[Completion] = await asyncio.wrap_future(ticket.future)
        except EngineError as exc:
            raise ApiError(503, client_text(exc.message), kind="server_error", code="engine_error") from None
        except asyncio.CancelledError:
            ticket.cancelled = True
            raise
        refused = next((c for c in completions if c.error is not None), None)
        if refused is not None:
            raise ApiError(400, refused.error or "the engine refused the request", code="engine_rejected")
        return completions

    def _response(self, url: str, completions: list[Completion], created: int) -> Any:
        body = answer_body(completions, self.settings.model, created)
        return ChatCompletion.model_validate(body) if url == CHAT_URL else TextCompletion.model_validate(body)

    async def _stream(self, events: Any, ticket: Ticket, url: str, rid: str, created: int,
                      usage_chunk: bool) -> AsyncIterator[str]:
        model = ticket.requests[0].adapter or self.settings.model
        head: dict[str, Any] = {"id": f"{'chatcmpl' if url == CHAT_URL else 'cmpl'}-{rid}", "created": created,
                                "model": model}
        try:
            if url == CHAT_URL:  # the role at once: the client knows the answer is on its way
                n = ticket.requests[0].sampling.get("n", 1)
                yield _event(ChatCompletionChunk(**head, choices=[
                    ChunkChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(n)]), usage_chunk)
            try:
                completions = await self._wait(ticket)
            except ApiError as exc:  # the stream has begun: the error goes as an event, as vLLM's server sends it
                yield f"data: {json.dumps(exc.body())}\n\n"
                yield "data: [DONE]\n\n"
                return
            body = answer_body(completions, self.settings.model, created)
            for chunk in events(head, body):
                yield _event(chunk, usage_chunk)
            if usage_chunk:
                chunk_type = ChatCompletionChunk if url == CHAT_URL else TextCompletionChunk
                yield _event(chunk_type(**head, choices=[], usage=Usage(**body["usage"])), True)
            yield "data: [DONE]\n\n"
        finally:
            ticket.cancelled = True  # a client gone mid-stream: rows not yet in an engine never go


def answer_body(completions: list[Completion], model: str, created: int) -> dict[str, Any]:
    """The response body of one request's completions: a batch output line's (assemble.openai_body), the
    reasoning also as `reasoning_content`."""
    from qbatch.output.assemble import openai_body
    from qbatch.output.tables import results_table

    rows = results_table(completions, ["online"], include_prompt=False).to_pylist()
    body = openai_body(rows, model, created)
    for choice in body["choices"]:
        message = choice.get("message")
        if message is not None and message.get("reasoning") is not None:
            message["reasoning_content"] = message["reasoning"]
    return body


def embedding_list(embeddings: list[Any], settings: Any, model: str, *, as_base64: bool) -> EmbeddingList:
    """OpenAI's embeddings response: the vectors as a `/v1/embeddings` batch's output lines hold them
    (output/embeddings.py: --dimensions, --normalize), one item an input, in order."""
    from qbatch.output.embeddings import embeddings_table

    rows = embeddings_table(embeddings, ["online"], settings, include_prompt=False).to_pylist()
    items = [EmbeddingItem(index=i, embedding=_base64(row["embedding"]) if as_base64 else row["embedding"])
             for i, row in enumerate(rows)]
    tokens = sum(row["prompt_tokens"] for row in rows)
    return EmbeddingList(data=items, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _base64(vector: list[float]) -> str:
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _chat_events(head: dict[str, Any], body: dict[str, Any]) -> list[ChatCompletionChunk]:
    """Each choice's reasoning and answer as deltas, then its finish."""
    chunks = []
    for choice in body["choices"]:
        message, index = choice["message"], choice["index"]
        if message.get("reasoning") is not None:
            reasoning = message["reasoning"]
            chunks.append(ChatCompletionChunk(**head, choices=[ChunkChoice(
                index=index, delta={"reasoning_content": reasoning, "reasoning": reasoning})]))
        chunks.append(ChatCompletionChunk(**head, choices=[ChunkChoice(
            index=index, delta={"content": message["content"]}, logprobs=choice.get("logprobs"))]))
        chunks.append(ChatCompletionChunk(**head, choices=[ChunkChoice(
            index=index, delta={}, finish_reason=choice["finish_reason"])]))
    return chunks


def _text_events(head: dict[str, Any], body: dict[str, Any]) -> list[TextCompletionChunk]:
    return [TextCompletionChunk(**head, choices=[TextChoice.model_validate(choice)]) for choice in body["choices"]]


def _event(chunk: Any, usage_chunk: bool) -> str:
    """One server-sent event; with include_usage every chunk carries `usage` (null until the last), as OpenAI's."""
    data = chunk.model_dump(exclude=None if usage_chunk else {"usage"})
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

