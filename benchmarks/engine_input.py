"""What vLLM's input processor costs a row: a raw token prompt against vLLM's own engine input.

`python benchmarks/engine_input.py MODEL [ROWS] [TOKENS]` (default 3,000 rows of 800 tokens): one small
eager engine, then `InputProcessor.process_inputs` for every row, timed alone (nothing is sent to the engine
core), three rounds of each form in turn: `{"prompt_token_ids": ids}` (parsed and rendered again per row, the
path vLLM deprecates) and `{"type": "token", "prompt_token_ids": ids}` (what qbatch's engines send since
12554b0). Prints microseconds a row.
"""

from __future__ import annotations

import sys
import time

FORMS = {"raw": lambda ids: {"prompt_token_ids": ids}, "typed": lambda ids: {"type": "token", "prompt_token_ids": ids}}


def main(model: str, rows: int = 3000, tokens: int = 800) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=2048, max_num_seqs=8, enforce_eager=True, kv_cache_memory_bytes=1 << 28)
    processor = llm.llm_engine.input_processor
    tasks = llm.llm_engine.get_supported_tasks()
    prompts = [[(i * 7 + j) % 1000 + 10 for j in range(tokens)] for i in range(rows)]
    params = SamplingParams(max_tokens=4)
    for round_ in range(3):
        for name, form in FORMS.items():
            started = time.perf_counter()
            for i, ids in enumerate(prompts):
                processor.process_inputs(f"{name}{round_}-{i}", form(ids), params, supported_tasks=tasks)
            print(f"{name} round {round_}: {(time.perf_counter() - started) / rows * 1e6:.1f} us a row", flush=True)


if __name__ == "__main__":  # vLLM's engine starts in a spawned process, which imports this file again
    main(sys.argv[1], *map(int, sys.argv[2:]))
