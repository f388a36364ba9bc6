"""Documents asked several questions, rows scattered: qbatch's --order longest-first (prefix groups)
vs longest-first-flat on one warm Session; prints one JSON line per run (generate time, share of
prompt tokens served from vLLM's prefix cache).

Every document is the same words shuffled, so all have one token count and the length sort alone
scatters a document's questions (documents of different lengths keep them together already).

Usage: python benchmarks/prefix_order.py MODEL [--docs 48] [--questions 4] [--doc-words 500]
       [--repeats 2] [--max-tokens 1] [--kv-cache-memory-bytes 8388608] [--max-model-len 1024]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "lambda", "theta", "zeta"]


def write_rows(path: Path, docs: int, questions: int, doc_words: int, seed: int = 11) -> None:
    rng = random.Random(seed)
    bag = [WORDS[i % len(WORDS)] for i in range(doc_words)]
    texts = ["Document: " + " ".join(rng.sample(bag, len(bag))) for _ in range(docs)]
    rows = [{"id": f"d{d}q{q}", "prompt": f"{texts[d]}\n\nQuestion: " + " ".join(rng.choices(WORDS, k=rng.randrange(1, 40)))}
            for d in range(docs) for q in range(questions)]
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--docs", type=int, default=48)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args()
    from qbatch.session.session import Session

    engine = {k: v for k, v in (("kv_cache_memory_bytes", args.kv_cache_memory_bytes),
                                 ("max_model_len", args.max_model_len)) if v is not None}
    with tempfile.TemporaryDirectory() as work, Session(model=args.model, **engine) as session:
        path = Path(work) / "docs.jsonl"
        write_rows(path, args.docs, args.questions, args.doc_words)
        for _ in range(args.repeats):
            for order in ("longest-first", "longest-first-flat"):
                result = session.run(str(path), max_tokens=args.max_tokens, order=order, progress="none")
                rows = result.results
                print(json.dumps({"order": order, "rows": rows.height, "generate_s": round(result.summary.generate_s, 2),
                                  "cached_share": round(rows["cached_tokens"].sum() / rows["prompt_tokens"].sum(), 3)}),
                      flush=True)


if __name__ == "__main__":
    main()
