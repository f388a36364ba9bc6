"""LoRA adapters on the real engine: rows of two adapters and of the base model in one run each get their own
model's answer, the answer vLLM's own LLM.generate(..., lora_request=...) gives on the same engine; an adapter
vLLM cannot load (a .bin that is no torch file: qbatch reads no pickle) fails its own rows, not the engine. (Rows reach
data-parallel workers with their adapter: tests/jobs/test_lora_null.py checks the worker messages; the process
tree itself is tests/jobs/test_signals.py's.)"""

from __future__ import annotations

import polars as pl
import pytest

from qbatch.bench.adapters import write_random_adapter

pytestmark = pytest.mark.slow

PROMPTS = ["The cat sat on", "Numbers: one two", "Write a word", "A B C D E F", "Hello world", "Red green blue"]


@pytest.fixture(scope="module")
def adapters_and_rows(tiny_qwen3, tmp_path_factory):
    """Two random adapters of the model (seeded), and rows naming one, the other, or none in turn. One pair
    of folders for the module: the tests' single engines have the same settings, one start."""
    folder = tmp_path_factory.mktemp("adapters")
    folders = {name: write_random_adapter(folder / name, tiny_qwen3, rank=8, seed=seed)
               for name, seed in (("one", 1), ("two", 2))}
    broken = folder / "zbroken"  # named last: the others keep vLLM ids 1 and 2
    write_random_adapter(broken, tiny_qwen3, rank=8, seed=3)
    (broken / "adapter_model.safetensors").unlink()
    (broken / "adapter_model.bin").write_bytes(b"not a torch file")
    folders["zbroken"] = broken
    choice = [None, "one", "two", "zbroken"]
    return folders, [{"id": f"r{i}", "prompt": text, "adapter": choice[i % 4]} for i, text in enumerate(PROMPTS * 2)]


def run(cli, model: str, folders, path, out, *flags: str) -> dict:
    """`qbatch run` of the rows, greedy, their results by id."""
    result = cli("run", path, "-o", out, "--model", model, "--raw", "--no-thinking", "--temperature", 0,
                 "--max-tokens", 8, "--max-model-len", 256, "--lora", f"one={folders['one']}",
                 "--lora", f"two={folders['two']}", "--lora", f"zbroken={folders['zbroken']}", "--progress", "none",
                 *flags)
    assert result.exit_code == 0, result.output
    errors = pl.read_parquet(out / "errors.parquet").to_dicts()
    assert {e["id"] for e in errors} == {"r3", "r7", "r11"} and {e["error"] for e in errors} == {"engine_rejected"}
    assert errors[0]["message"].startswith(f"vLLM rejected the request: adapter zbroken ({folders['zbroken'].resolve()}) "
                                           "did not load in vLLM: "), errors[0]["message"]
    return {r["id"]: r for r in pl.read_parquet(out / "results.parquet").to_dicts()}


def test_rows_of_two_adapters_and_the_base_get_their_own_models_answers(cli, engine_pool, tiny_qwen3, write_jsonl,
                                                                        tmp_path, adapters_and_rows):
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    folders, all_rows = adapters_and_rows
    results = run(cli, tiny_qwen3, folders, write_jsonl(all_rows), tmp_path / "out")
    rows = [row for row in all_rows if row["adapter"] != "zbroken"]
    assert [results[row["id"]]["adapter"] for row in rows] == [row["adapter"] for row in rows]

    # vLLM's own answers on the engine the run used: every prompt under each model, one model at a time
    (engine,) = [e for e in engine_pool.engines() if "one" in getattr(e, "adapters", ())]  # the pool holds others too
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    prompts = [{"prompt_token_ids": tokenizer(text)["input_ids"]} for text in PROMPTS * 2]
    params = SamplingParams(temperature=0, max_tokens=8)
    requests = {None: None, **{name: LoRARequest(name, number, str(folders[name].resolve()))
                               for number, name in enumerate(sorted(folders), start=1) if name != "zbroken"}}
    expected = {name: [o.outputs[0].text for o in engine.llm.generate(prompts, params, lora_request=request,
                                                                       use_tqdm=False)]
                for name, request in requests.items()}
    for i, row in enumerate(all_rows):
        if row["adapter"] != "zbroken":
            assert results[row["id"]]["text"] == expected[row["adapter"]][i], (row, expected)
    # each adapter changes the answers (random weights, large enough to change greedy choices)
    for name in ("one", "two"):
        assert sum(a != b for a, b in zip(expected[name], expected[None], strict=True)) >= len(PROMPTS)

