"""QbatchChat through LangChain's own API on the null engine: batch is one Session call."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402

from qbatch.session import Session  # noqa: E402
from qbatch.session.langchain import QbatchChat  # noqa: E402


@pytest.fixture(scope="module")
def chat(bundled_model):
    with Session(bundled_model, backend="null") as session:
        yield QbatchChat(session=session, max_tokens=8)


@pytest.fixture
def calls(monkeypatch):
    """The job settings of every Session call."""
    from qbatch.jobs import runner

    seen: list[dict] = []
    run = runner.run

    def counting(spec, *args, **kwargs):
        seen.append(spec.flat())
        return run(spec, *args, **kwargs)

    monkeypatch.setattr(runner, "run", counting)
    return seen


def test_batch_is_one_session_call(chat, calls):
    inputs = ["short", [SystemMessage("be brief"), HumanMessage("a longer question here")], "third one"]
    answers = chat.batch(inputs)
    assert len(calls) == 1
    assert [type(a) for a in answers] == [AIMessage] * 3
    for answer in answers:  # each answer belongs to its own input (the null engine echoes the prompt's length)
        assert answer.content == f"[null engine: {answer.usage_metadata['input_tokens']} prompt tokens]"
    assert len({a.usage_metadata["input_tokens"] for a in answers}) == 3
    assert answers[0].response_metadata["finish_reason"] == "length"


def test_invoke_and_per_call_settings(chat, calls):
    answer = chat.invoke("hello", max_tokens=4, enable_thinking=False)
    assert isinstance(answer, AIMessage) and answer.content
    assert calls[-1]["max_tokens"] == 4 and calls[-1]["thinking"] is False
    chat.invoke("hello", stop=["x"])
    assert calls[-1]["stop"] == ["x"] and calls[-1]["max_tokens"] == 8


def test_batch_failed_rows_as_exceptions(chat, calls):
    answers = chat.batch(["fine", "   "], return_exceptions=True)
    assert isinstance(answers[0], AIMessage)
    assert isinstance(answers[1], Exception) and "empty_prompt" in str(answers[1])
    assert len(calls) == 1


def test_every_conversation_failed(chat):
    from qbatch.errors import InputError

    with pytest.raises(InputError, match="empty_prompt"):
        chat.invoke("   ")
    answers = chat.batch(["", "   "], return_exceptions=True)
    assert [type(a) for a in answers] == [InputError, InputError]


def test_several_answers_a_conversation_are_refused(chat):
    from qbatch.errors import SpecError

    with pytest.raises(SpecError, match="the quick paths return one"):
        chat.batch(["a", "b"], n=2)


def test_abatch_and_chains(chat, calls):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    answers = asyncio.run(chat.abatch(["a", "b"]))
    assert len(answers) == 2 and len(calls) == 1
    chain = ChatPromptTemplate.from_messages([("human", "Summarize: {text}")]) | chat | StrOutputParser()
    texts = chain.batch([{"text": "one"}, {"text": "two two"}])
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts) and len(calls) == 2
