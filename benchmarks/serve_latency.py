"""Latency and throughput of a running `qbatch serve`, through the openai client; prints JSON.

latency: a ROWS-row batch (~190 prompt / 256 output tokens by default) from `client.files.create`
+ `client.batches.create` to the output file downloaded, REPEATS times on the warm service (issue
#18's target on an H200: <= 3 s for 200 rows). throughput: one THROUGHPUT_ROWS-row batch, output
tokens per second from create to download (compare with `qbatch run`'s generate throughput).

Usage: python benchmarks/serve_latency.py --base-url http://127.0.0.1:8000/v1 [--rows 200]
       [--repeats 3] [--throughput-rows 4096] [--max-tokens 256] [--prompt-words 140] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

TERMINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 0.05
WORDS = "the of and to in is that for it as with was on be by at this from or an are which".split()


def batch_file(rows: int, *, prompt_words: int, max_tokens: int, seed: int, tag: str) -> bytes:
    """Chat requests of about `prompt_words` words each (~1.3 tokens a word), ignore_eos so every
    row generates `max_tokens` tokens."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        text = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
        body = {"messages": [{"role": "user", "content": f"{tag} {i}: {text}"}], "max_completion_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0}
        lines.append(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def one_batch(client: Any, data: bytes, timeout_s: float) -> dict[str, Any]:
    """Upload, create, poll, download: the seconds of each step and the rows/tokens out."""
    t0 = time.perf_counter()
    file = client.files.create(file=("bench.jsonl", data), purpose="batch")
    t_upload = time.perf_counter()
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    t_create = time.perf_counter()
    deadline = t_create + timeout_s
    while batch.status not in TERMINAL:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"batch {batch.id} not done after {timeout_s}s ({batch.status})")
        time.sleep(POLL_S)
        batch = client.batches.retrieve(batch.id)
    t_done = time.perf_counter()
    output = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
    t_download = time.perf_counter()
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]
    completion_tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)
    prompt_tokens = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in lines)
    return {"status": batch.status, "rows_ok": len(lines), "rows_failed": batch.request_counts.failed,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "upload_s": round(t_upload - t0, 4), "create_to_done_s": round(t_done - t_upload, 4),
            "create_to_download_s": round(t_download - t_upload, 4), "total_s": round(t_download - t0, 4),
            "output_tok_s": round(completion_tokens / max(t_download - t_upload, 1e-9), 1)}


def measure(base_url: str, *, api_key: str = "unused", rows: int = 200, repeats: int = 3, throughput_rows: int = 0,
            max_tokens: int = 256, prompt_words: int = 140, timeout_s: float = 3600.0) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    latency = [one_batch(client, batch_file(rows, prompt_words=prompt_words, max_tokens=max_tokens, seed=r,
                                            tag=f"lat{r}"), timeout_s) for r in range(repeats)]
    report: dict[str, Any] = {
        "base_url": base_url, "model": model, "rows": rows, "max_tokens": max_tokens, "prompt_words": prompt_words,
        "latency_runs": latency,
        "latency_create_to_download_s": {"median": statistics.median(r["create_to_download_s"] for r in latency),
                                         "min": min(r["create_to_download_s"] for r in latency)},
    }
    if throughput_rows:
        report["throughput"] = one_batch(client, batch_file(throughput_rows, prompt_words=prompt_words,
                                                            max_tokens=max_tokens, seed=99, tag="tput"), timeout_s)
        report["throughput_rows"] = throughput_rows
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput-rows", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=140)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    report = measure(args.base_url, api_key=args.api_key, rows=args.rows, repeats=args.repeats,
                     throughput_rows=args.throughput_rows, max_tokens=args.max_tokens,
                     prompt_words=args.prompt_words, timeout_s=args.timeout_s)
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
