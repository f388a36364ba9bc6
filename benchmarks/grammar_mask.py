"""Issue #52: what a JSON-schema row costs the CPU at each step, the mask of allowed tokens that vLLM's guidance
backend (qbatch's default, plan/engine_args.py GUIDANCE) fills for it before the step's sampling.

    python benchmarks/grammar_mask.py [MODEL_DIR] [--rows 64]

llguidance's matcher for `answers_gpu.py`'s extraction schema (compact JSON, as qbatch asks), ROWS of them walked
through one valid object token by token; each step fills every row's mask on one thread, as each of vLLM's fill
threads does (vLLM splits a step's rows over at most 8 threads an engine). Prints microseconds a row a step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from answers_gpu import SCHEMA  # noqa: E402 - the schema of the GPU runs

OBJECT = '{"customer":"Acme Industries Limited","amount":1234.5,"refund":true}'


def main() -> None:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import AutoTokenizer

    args = sys.argv[1:]
    rows = int(args[args.index("--rows") + 1]) if "--rows" in args else 64
    model = next((a for a in args if not a.startswith("--") and not a.isdigit()),
                 str(Path(__file__).parents[2] / "shared/models/qwen3-0.6b-dummy"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocabulary = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(vocabulary, grammar) for _ in range(rows)]
    mask = allocate_token_bitmask(rows, vocabulary.vocab_size)
    tokens = tokenizer.encode(OBJECT, add_special_tokens=False)
    filling = 0.0
    for token in tokens:
        t0 = time.perf_counter()
        for i, matcher in enumerate(matchers):
            fill_next_token_bitmask(matcher, mask, i)
        filling += time.perf_counter() - t0
        for matcher in matchers:
            if not matcher.consume_token(token):
                raise SystemExit(f"the grammar refused token {token} of {OBJECT!r}")
    print(f"vocabulary {vocabulary.vocab_size:,}, {len(tokens)} steps, {rows} rows: "
          f"{filling / len(tokens) / rows * 1e6:.1f} us a row a step (one thread)")


if __name__ == "__main__":
    main()
