"""QbatchChat: a LangChain chat model on a Session (extra `langchain`: langchain-core only).

`batch()` sends every conversation through one Session call (qbatch's sorted chunks on the warm
engine), then lets LangChain's own `invoke` hand each answer out, so callbacks, tracing and
`return_exceptions` work as for any chat model. `invoke()` alone is a call of one row.
The reasoning of thinking models is returned separately, as LangChain's OpenAI-compatible
models do: `AIMessage.additional_kwargs["reasoning_content"]`.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from contextvars import ContextVar
from typing import Any

from qbatch.errors import InputError, MissingDependency
from qbatch.session.reply import Reply

try:
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, BaseMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langchain_core.runnables.config import get_config_list
except ImportError:
    raise MissingDependency("langchain-core is not installed", hint="pip install 'qbatch[langchain]'") from None

ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
# Answers computed by batch() for the invoke() calls it makes next, by conversation and settings.
_PREPARED: ContextVar[dict[str, deque[Reply]] | None] = ContextVar("qbatch_prepared", default=None)


class QbatchChat(BaseChatModel):
    """A chat model answering on a qbatch Session's warm engine.

    Sampling fields left None use the model's generation_config (as `qbatch run` does); any
    `qbatch run` job setting may also be passed per call (`chat.invoke(m, max_tokens=64)`).
    """

    session: Any  # a qbatch.Session (Any: pydantic checks nothing of it)
    enable_thinking: bool | None = None  # Qwen3's thinking; None: the chat template's default
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None

    @property
    def _llm_type(self) -> str:
        return "qbatch"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.session.engine_settings["model"], **self._settings(None, {})}

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        conversation = _conversation(messages)
        settings = self._settings(stop, kwargs)
        prepared = (_PREPARED.get() or {}).get(_key(conversation, settings))
        reply = prepared.popleft() if prepared else self.session.replies("messages", [conversation], **settings)[0]
        return ChatResult(generations=[ChatGeneration(message=self._message(reply))])

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[Any]:
        """All inputs in one Session call; LangChain's invoke then hands out each answer."""
        if not inputs:
            return []
        stop = kwargs.get("stop")
        settings = self._settings(stop, {k: v for k, v in kwargs.items() if k != "stop"})
        conversations = [_conversation(self._convert_input(item).to_messages()) for item in inputs]
        prepared: dict[str, deque[Reply]] = {}
        for conversation, reply in zip(conversations, self.session.replies("messages", conversations, **settings),
                                       strict=True):
            prepared.setdefault(_key(conversation, settings), deque()).append(reply)
        token = _PREPARED.set(prepared)
        try:
            return [self._invoke_one(item, cfg, return_exceptions, kwargs)
                    for item, cfg in zip(inputs, get_config_list(config, len(inputs)), strict=True)]
        finally:
            _PREPARED.reset(token)

    async def abatch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
                     **kwargs: Any) -> list[Any]:
        return await asyncio.to_thread(self.batch, inputs, config, return_exceptions=return_exceptions, **kwargs)

    def _invoke_one(self, item: Any, config: Any, return_exceptions: bool, kwargs: dict[str, Any]) -> Any:
        try:
            return self.invoke(item, config, **kwargs)
        except Exception as exc:
            if not return_exceptions:
                raise
            return exc

    def _settings(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The Session job settings of a call: the model's fields, then the call's keyword arguments."""
        settings = {"thinking": self.enable_thinking, "max_tokens": self.max_tokens,
                    "temperature": self.temperature, "top_p": self.top_p, "stop": stop}
        kwargs = dict(kwargs)
        if "enable_thinking" in kwargs:
            settings["thinking"] = kwargs.pop("enable_thinking")
        settings.update(kwargs)
        return {k: v for k, v in settings.items() if v is not None}

    def _message(self, reply: Reply) -> AIMessage:
        if reply.error is not None:
            raise InputError(f"the conversation failed: {reply.error}: {reply.message}",
                             hint="see the message; qbatch checks each row as `qbatch run` does")
        extra = {"reasoning_content": reply.reasoning} if reply.reasoning is not None else {}
        usage = {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}
        return AIMessage(content=reply.text or "", additional_kwargs=extra, usage_metadata=usage,
                         response_metadata={"finish_reason": reply.finish_reason,
                                            "model_name": self.session.engine_settings["model"]})


def _conversation(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the {role, content} dicts of a `messages` row."""
    out = []
    for message in messages:
        role = getattr(message, "role", None) if message.type == "chat" else ROLES.get(message.type)
        if role is None:
            raise InputError(f"cannot send a {message.type} message", where="QbatchChat",
                             hint="use system, human, ai or tool messages")
        out.append({"role": role, "content": message.content})
    return out


def _key(conversation: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    return json.dumps([conversation, settings], sort_keys=True, default=str)
