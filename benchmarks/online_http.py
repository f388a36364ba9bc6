"""Issue #54 without a GPU: the waits the whole online path adds, HTTP included, on a stand-in engine with fixed steps.

The real service (serve_in_thread: uvicorn, the routes, the Feeder) in a process of its own, with one engine in
it as `qbatch serve --engines-per-gpu 1` has: the real VllmEngine.run over online_steps.py's stand-in for vLLM's
LLMEngine (each step sleeps STEP_MS, a request is done MAX_TOKENS steps after it joined). This process sends
ROWS chat requests from CLIENTS threads through the `openai` SDK, as `benchmarks/online_gpu.py` does on the GPU:
requests/s and p50/p90 against the floor (MAX_TOKENS x STEP_MS a request).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/online_http.py [--rows 600] [--clients 64] [--step-ms 3.3]
        [--max-tokens 256] [--model smollm2-135m] [--stream]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory


def serve(port: int, data: str, model: str, step_s: float) -> None:
    """The service on a stepped stand-in engine, until killed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from online_steps import stepped_engine

    from qbatch.engines.pool import EnginePool
    from qbatch.log import setup as setup_log
    from qbatch.models import registry as models
    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import serve_in_thread
    from qbatch.tokens import TextEncoder, load_tokenizer

    setup_log()
    path = models.resolve(model)
    engine = stepped_engine(step_s)
    engine._encoder = TextEncoder(load_tokenizer(path))  # online rows come as text, encoded by the engine
    settings = ServeSettings(Path(data), {"model": path, "backend": "null"}, {"progress": "none"}, port=port)
    _, server, thread = serve_in_thread(settings, pool=EnginePool(start=lambda *args, **kwargs: engine))
    thread.join()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=3.3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stream", action="store_true", help="each answer as server-sent events, read to the end")
    parser.add_argument("--serve", nargs=3, metavar=("PORT", "DATA", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    step_s = args.step_ms / 1000
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.serve[2], step_s)
        return
    from openai import OpenAI

    port = free_port()
    with TemporaryDirectory() as data:
        proc = subprocess.Popen([sys.executable, __file__, "--step-ms", str(args.step_ms), "--serve", str(port), data,
                                 args.model], stdout=subprocess.DEVNULL, stderr=open(Path(data) / "serve.log", "w"))
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
            deadline = time.monotonic() + 120
            while True:
                try:
                    model = client.models.list().data[0].id
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.2)

            def ask(i: int) -> float:
                t0 = time.perf_counter()
                answer = client.chat.completions.create(model=model, max_tokens=args.max_tokens, stream=args.stream,
                                                        messages=[{"role": "user", "content": f"Question {i}"}])
                if args.stream:
                    list(answer)
                return time.perf_counter() - t0

            with ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(ask, range(args.clients)))  # warm: connections, threads, the driver
                t0 = time.perf_counter()
                times = list(pool.map(ask, range(args.rows)))
                wall = time.perf_counter() - t0
        finally:
            proc.kill()
            proc.wait()
    floor = args.max_tokens * step_s
    print(json.dumps({**{k: v for k, v in vars(args).items() if k != "serve"},
                      "requests_s": round(args.rows / wall, 2),
                      "floor_requests_s": round(args.clients / floor, 2),
                      "p50_s": round(statistics.median(times), 4), "p90_s": round(statistics.quantiles(times, n=10)[-1], 4),
                      "max_s": round(max(times), 4), "floor_s": round(floor, 4)}))


if __name__ == "__main__":
    main()
