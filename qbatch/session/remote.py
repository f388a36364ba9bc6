"""A Session's quick paths on a running `qbatch serve`: many notebooks, one warm engine.

`Session(server=URL)` (a RemoteSession) answers `generate`, `chat` and `replies` as a Session does (the same
Reply records, failed rows included), by sending each row to the service's online route
`/v1/chat/completions` at once, from a pool of threads: the service gathers them onto its engine
(serve/gather.py). `QbatchChat(session=RemoteSession(URL))` is the LangChain model on it. The
settings are the quick paths' (max_tokens, temperature, top_p, seed, stop, thinking, ...); `run()`
and `embed()` stay in-process: hand a whole job to a service with `qbatch run --server`, or as a batch.
Standard library only: a client needs no web stack.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from qbatch.errors import EngineError, InputError, SpecError
from qbatch.session.reply import Reply

MAX_CONCURRENT = 64  # rows in flight to the service at once: what it gathers into one engine chunk
TIMEOUT_S = 600.0
# The quick paths' settings, sent by their names as body keys (the service applies them as a batch line's)
BODY_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "logit_bias", "n")


class RemoteSession:
    """The quick paths of a Session, on the engines of the `qbatch serve` at `server` (its URL, with or
    without /v1). `api_key`: the service's `--api-key` (default: QBATCH_API_KEY)."""

    def __init__(self, server: str, *, api_key: str | None = None, timeout_s: float = TIMEOUT_S, **settings: Any):
        """`settings`: a Session's engine settings are the service's: only its `model` may be given, and must match."""
        self.base_url = server.rstrip("/").removesuffix("/v1") + "/v1"
        self.api_key = api_key if api_key is not None else os.environ.get("QBATCH_API_KEY")
        self.timeout_s = timeout_s
        self.closed = False
        self.engine_settings = {"model": self._model()}
        unknown = sorted(set(settings) - {"model"})
        if unknown:
            raise SpecError(f"{unknown[0]} is an engine setting; a Session on a server runs the service's engines",
                            where="Session(server=...)", hint="give the service its settings: qbatch serve --help")
        if settings.get("model") not in (None, self.engine_settings["model"]):
            raise SpecError(f"the service runs {self.engine_settings['model']!r}, not {settings['model']!r}",
                            where="Session(server=...)", hint="leave model out, or start a service of that model")

    def generate(self, prompts: Sequence[str], **settings: Any) -> list[str]:
        """Completions of prompt strings, in order (each sent as a user turn through the chat template)."""
        return texts(self.replies("prompt", prompts, **settings))

    def chat(self, conversations: Sequence[list[dict[str, Any]]], **settings: Any) -> list[str]:
        return texts(self.replies("messages", conversations, **settings))

    def replies(self, column: str, values: Sequence[Any], **settings: Any) -> list[Reply]:
        """One Reply per value of a `prompt` or `messages` column, in order, failed rows included."""
        if column not in ("prompt", "messages"):
            raise SpecError(f"column must be 'prompt' or 'messages', got {column!r}")
        if isinstance(values, (str, bytes, dict)):
            raise InputError(f"expected a list of {column} values, got {type(values).__name__}",
                             hint="wrap one value in a list")
        body = self._body(settings)
        conversations = [[{"role": "user", "content": v}] if column == "prompt" else v for v in values]
        with ThreadPoolExecutor(min(MAX_CONCURRENT, max(1, len(conversations)))) as pool:
            return list(pool.map(lambda messages: self._reply({**body, "messages": messages}), conversations))

    def run(self, data: Any, **settings: Any) -> Any:
        raise SpecError("run() takes a whole job, which a RemoteSession does not send", where="RemoteSession.run",
                        hint="qbatch run --server URL hands a job to the service; a batch (POST /v1/batches) too")

    def close(self) -> None:
        self.closed = True  # the engines are the service's

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteSession({self.base_url!r}, model={self.engine_settings['model']!r})"

    # -- internals -------------------------------------------------------------------
    def _body(self, settings: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.engine_settings["model"]}
        for key, value in settings.items():
            name = key.replace("-", "_")
            if name == "thinking":
                if value is not None:
                    body["chat_template_kwargs"] = {"enable_thinking": bool(value)}
            elif name in BODY_KEYS:
                if value is not None:
                    body[name] = value
            else:
                raise SpecError(f"{name} is not a setting a RemoteSession sends to the service", where=f"{name}=",
                                hint=f"its settings: thinking, {', '.join(BODY_KEYS)}")
        return body

    def _reply(self, body: dict[str, Any]) -> Reply:
        status, answer = self._post("/chat/completions", body)
        if status != 200:
            error = answer.get("error") or {}
            return Reply(None, error=error.get("code") or f"http_{status}", message=error.get("message"))
        choice, usage = answer["choices"][0], answer["usage"]
        message = choice["message"]
        return Reply(message.get("content"), message.get("reasoning_content"), choice.get("finish_reason"),
                     usage["prompt_tokens"], usage["completion_tokens"])

    def _model(self) -> str:
        status, answer = self._request("GET", "/models", None)
        if status != 200:
            raise EngineError(f"the service at {self.base_url} answered {status} to GET /models: "
                              f"{(answer.get('error') or {}).get('message')}",
                              hint="check the URL and the API key (api_key=, or QBATCH_API_KEY)")
        return str(answer["data"][0]["id"])

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self._request("POST", path, json.dumps(body).encode())

    def _request(self, method: str, path: str, data: bytes | None) -> tuple[int, dict[str, Any]]:
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read())
            except ValueError:
                return exc.code, {}
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"cannot reach the service at {self.base_url}: {getattr(exc, 'reason', exc)}",
                              hint="start it with `qbatch serve`, or use an in-process qbatch.Session") from None


def texts(replies: list[Reply]) -> list[str]:
    """The answers' texts; InputError naming the first row the service refused."""
    for index, reply in enumerate(replies):
        if reply.error is not None:
            raise InputError(f"the service refused prompt {index}: {reply.error}: {reply.message}",
                             where=f"prompt {index}", hint="session.replies(...) returns every row's Reply")
    return [reply.text or "" for reply in replies]
