"""The chat-template splice gives exactly jinja's render, or stands aside (qbatch/splice.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import QWEN3_TEMPLATE
from qbatch.inputs.splice import PROBES, ChatSplicer, content_uses

TEMPLATES = Path(__file__).parents[1] / "templates"
TEXTS = [
    *PROBES, " leading space", "trailing newline\n", "\tTab first", "", "   ", "ping", "pin",
    "<tool_response>\nresult\n</tool_response>", "a </think> b", "<think>x", "x<tool_response>",
    "Question 7: Compose an engaging travel blog post about a recent trip to Hawaii.",
]


@pytest.fixture(scope="module")
def tokenizer(bundled_model):
    from qbatch.tokens import load_tokenizer

    return load_tokenizer(bundled_model)


def _templates(tokenizer) -> dict[str, str]:
    return {"smollm2": tokenizer.get_chat_template(), "qwen3": (TEMPLATES / "qwen3.jinja").read_text(),
            "qwen3-ish": QWEN3_TEMPLATE}


def _renderer(tokenizer, template: str):
    def render(conversation, thinking):
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **kwargs)

    return render


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "qwen3-ish"])
@pytest.mark.parametrize("system", [None, "Be brief."])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_splice_equals_the_real_render(tokenizer, name, system, thinking):
    template = _templates(tokenizer)[name]
    render = _renderer(tokenizer, template)
    splicer = ChatSplicer(template, render)
    head = [] if system is None else [{"role": "system", "content": system}]
    spliced = 0
    for text in TEXTS:
        conversation = [*head, {"role": "user", "content": text}]
        got = splicer.render(conversation, thinking)
        if got is not None:
            assert got == render(conversation, thinking), text[:80]
            spliced += 1
    assert spliced >= len(PROBES) - 6  # the fast path is taken for ordinary texts


def test_texts_the_template_looks_into_are_left_to_jinja(tokenizer):
    template = _templates(tokenizer)["qwen3"]
    splicer = ChatSplicer(template, _renderer(tokenizer, template))
    assert splicer.uses is not None
    assert splicer.uses.substrings == {"<tool_response>", "</tool_response>", "<think>", "</think>"}
    for text in ("<tool_response>\nx\n</tool_response>", "a </think> b", " edge", "edge\n", ""):
        assert splicer.render([{"role": "user", "content": text}], None) is None
    assert splicer.render([{"role": "user", "content": "plain"}], None) is not None
    assert splicer.render([{"role": "assistant", "content": "plain"}], None) is None  # only one user turn
    two_turns = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert splicer.render(two_turns, None) is None


def test_equality_with_a_constant_is_guarded(tokenizer):
    template = ("{% for m in messages %}{% if m.content == 'ping' %}pong{% else %}{{ m.content }}{% endif %}"
                "{% endfor %}")
    render = _renderer(tokenizer, template)
    splicer = ChatSplicer(template, render)
    assert splicer.uses is not None and splicer.uses.constants == {"ping"}
    assert splicer.render([{"role": "user", "content": "ping"}], None) is None
    assert splicer.render([{"role": "user", "content": "pin"}], None) == render([{"role": "user", "content": "pin"}], None)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.content|upper }}{% endfor %}",
    "{% for m in messages %}{% if m.content|length > 5 %}long{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% set x %}{{ m.content }}{% endset %}{% if 'a' in x %}A{% endif %}{% endfor %}",
    "{% for m in messages %}{{ m['content'][0] }}{% endfor %}",
    "{% for m in messages %}{{ m.content.replace('a', 'b') }}{% endfor %}",
    "{% for m in messages %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{{ m|attr('content') }}{% endfor %}",
    "{% for m in messages %}{% if (m.content + 'x') == 'ax' %}A{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.content in 'abc' %}A{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% set c = m.content ~ '!' %}{% if c.startswith('a') %}A{% endif %}{% endfor %}",
    "{{ strftime_now('%d %b') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% macro show(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
])
def test_templates_that_inspect_content_are_not_spliced(template):
    assert content_uses(template) is None


def test_a_template_that_escapes_content_fails_its_probes(tokenizer):
    template = "{{ messages|tojson }}"  # no content read in sight, but the output escapes it
    splicer = ChatSplicer(template, _renderer(tokenizer, template))
    assert splicer.uses is not None
    assert splicer.render([{"role": "user", "content": "plain"}], None) is None


def test_preparer_gives_the_same_requests_with_and_without_splicing(write_jsonl, bundled_model):
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    rows = [{"id": f"p{i}", "prompt": text} for i, text in enumerate(TEXTS) if text.strip()]
    rows += [{"id": "chat", "messages": [{"role": "system", "content": "Own system."}, {"role": "user", "content": "hi"}]},
             {"id": "think", "prompt": "hello", "enable_thinking": False}]
    path = write_jsonl(rows)
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "system_prompt": "Be brief.",
                              "include_prompt": True})
    job = Job.setup(spec)
    window = list(job.identified_rows(set()))
    fast, fast_failures = job.preparer.prepare(window)
    assert job.preparer.splicer.render([{"role": "user", "content": "hi"}], None) is not None
    job.preparer.splicer.uses = None  # jinja only
    slow, slow_failures = job.preparer.prepare(window)
    assert [(r.id, r.prompt, r.tokens) for r in fast] == [(r.id, r.prompt, r.tokens) for r in slow]  # text, count
    assert fast_failures == slow_failures
    assert [f.error for f in fast_failures] == ["prompt_too_long"]  # the 100,000-character probe
    assert len(fast) + len(fast_failures) == len(rows)
