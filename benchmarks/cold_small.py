"""A job from a cold process: the ten-line vLLM script a user would write, against `qbatch run`.

`data FILE`: ROWS chat rows (~160 prompt tokens, `max_tokens` 256 each) as JSONL for both sides.
`workload NAME FILE MODEL [ROWS]`: one of `qbatch bench`'s workloads (its user messages and max_tokens,
drawn from MODEL's tokenizer as the bench draws them) as the same JSONL.
`raw FILE OUT MODEL [LLM kwargs as JSON]`: read the JSONL, `LLM(...)`, one `llm.chat(...)` with every
row (each row's max_tokens, ignore_eos, temperature 0), the texts to OUT as Parquet; prints the phases'
seconds as JSON. `best FILE OUT MODEL [LLM kwargs as JSON]`: the issue's "raw best" as a script, the same
rows rendered and tokenized first, `LLM(performance_mode="throughput")`, one `generate()` of token ids.
Time the whole process from outside (`date +%s%N` around it) and run `qbatch run FILE
-o OUT --ignore-eos --temperature 0` the same way, alternating the order (issue #34, targets 1 and 4:
first run against first run, end to end).
"""

from __future__ import annotations

import json
import random
import sys
import time

STARTED = time.monotonic()
WORDS = "the of and to in is that for it as with was on be by at this from or an are which".split()


def data(path: str, rows: int = 200, words: int = 120, max_tokens: int = 256) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"id": f"r{i}", "prompt": f"row {i}: {text}", "max_tokens": max_tokens}) + "\n")


def workload(name: str, path: str, model: str, rows: str = "") -> None:
    from pathlib import Path

    from transformers import AutoTokenizer

    from qbatch.bench.settings import DEFAULT_ROWS
    from qbatch.bench.workloads import make_workload

    tokenizer = AutoTokenizer.from_pretrained(model)
    made = make_workload(name, tokenizer, int(rows) if rows else DEFAULT_ROWS[name])
    made.write_jsonl(Path(path))
    print(json.dumps(made.describe()))


def raw(path: str, out: str, model: str, kwargs: str = "{}") -> None:
    import polars  # noqa: F401  (before import_s ends, so that write_s times the write alone)
    from vllm import LLM

    imported = time.monotonic()
    rows = _read(path)
    llm = LLM(model=model, **json.loads(kwargs))
    ready = time.monotonic()
    outputs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in rows], _params(rows), use_tqdm=False)
    _finish(rows, outputs, out, {"import_s": imported - STARTED, "engine_s": ready - imported}, ready)


def best(path: str, out: str, model: str, kwargs: str = "{}") -> None:
    import polars  # noqa: F401  (as in raw)
    from transformers import AutoTokenizer
    from vllm import LLM

    imported = time.monotonic()
    rows = _read(path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for r in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    tokenized = time.monotonic()
    llm = LLM(model=model, performance_mode="throughput", **json.loads(kwargs))
    ready = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], _params(rows), use_tqdm=False)
    _finish(rows, outputs, out, {"import_s": imported - STARTED, "tokenize_s": tokenized - imported,
                                 "engine_s": ready - tokenized}, ready)


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _params(rows: list[dict]) -> list:
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in rows]


def _finish(rows: list[dict], outputs: list, out: str, phases: dict[str, float], ready: float) -> None:
    """The texts to OUT as Parquet; the phases' seconds, generation's and the rest's, as one JSON line."""
    import polars as pl

    generated = time.monotonic()
    pl.DataFrame({"id": [r["id"] for r in rows], "text": [o.outputs[0].text for o in outputs]}).write_parquet(out)
    done = time.monotonic()
    print(json.dumps({**phases, "generate_s": generated - ready, "write_s": done - generated,
                      "in_process_s": done - STARTED,
                      "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}))


if __name__ == "__main__":  # vLLM spawns its engine: the module must import without running
    {"data": data, "workload": workload, "raw": raw, "best": best}[sys.argv[1]](*sys.argv[2:])
