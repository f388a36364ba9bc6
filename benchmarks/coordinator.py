"""How many engines one driver keeps fed (issue #55, point 4): the real `qbatch run` pipeline against
K simulated engines that answer at once (qbatch/bench/coordinator.py), for decode-heavy, prefill-heavy
and shared-document shapes, with the model's real tokenizer.

Prints one line a run (rows/s, prompt and output tok/s over the generation, the driver's CPU per
row, bytes a row on the wire) and, with --json, writes every run's figures. docs/benchmarks.md
("the coordinator's ceiling") has the figures and the arithmetic against one H200's rates.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/coordinator.py --model /work/shared/models/qwen3-0.6b-dummy \
        --shapes longgen,varied,prefill,prefill-short,docqa --engines 1,4,16,64 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from qbatch.bench.coordinator import run_coordinator, write_shape
from qbatch.spec import JobSpec

# Rows per shape: a full window (8,192 rows) or more, 10-30 s a run on 2 cores.
DEFAULT_ROWS = {"longgen": 10_000, "varied": 16_000, "short": 20_000, "prefill": 8_192, "prefill-short": 20_000,
                "prefill-mix": 4_096, "docqa": 8_000, "docqa-large": 8_000, "classify": 20_000}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (its tokenizer and chat template are used)")
    parser.add_argument("--shapes", default="longgen,prefill,docqa", help="bench workloads (qbatch/bench/workloads.py)")
    parser.add_argument("--gpus", default="1,4,16,64", help="simulated GPUs, a run each (--engines-per-gpu engines each)")
    parser.add_argument("--engines-per-gpu", type=int, default=2, help="qbatch's default for a small model on an H200")
    parser.add_argument("--rows", type=int, help="rows per shape (default: DEFAULT_ROWS)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seconds-per-token", type=float, default=0.0, help="an engine's batch time a token (0: at once)")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE", help="a `qbatch run` setting")
    parser.add_argument("--warmup-rows", type=int, default=2000,
                        help="a first run of the first shape, not recorded (0: none): the process's one-time work "
                             "(imports, vLLM's source read, the tokenizer's load) is a job's, not its rows'")
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args(argv)
    from qbatch.tokens import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    settings = dict(item.split("=", 1) for item in args.set)
    runs = []
    with tempfile.TemporaryDirectory(prefix="qbatch-coordinator-") as work:
        if args.warmup_rows:
            shape = args.shapes.split(",")[0]
            path = Path(work) / "warmup.jsonl"
            write_shape(shape, tokenizer, args.warmup_rows, path)
            run_coordinator(_spec(args, settings, path, Path(work), int(args.gpus.split(",")[0])), shape,
                            seconds_per_token=args.seconds_per_token)
        for shape in args.shapes.split(","):
            path = Path(work) / f"{shape}.jsonl"
            described = write_shape(shape, tokenizer, args.rows or DEFAULT_ROWS.get(shape, 10_000), path)
            print(f"{shape}: {described}", file=sys.stderr)
            for num_gpus in map(int, args.gpus.split(",")):
                for _ in range(args.repeats):
                    spec = _spec(args, settings, path, Path(work), num_gpus)
                    run = run_coordinator(spec, shape, seconds_per_token=args.seconds_per_token)
                    runs.append({**run.as_dict(), "tokenizer_cpu_ms_per_row": described["tokenizer_cpu_ms_per_row"]})
                    print(_line(runs[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def _spec(args: argparse.Namespace, settings: dict[str, str], path: Path, work: Path, num_gpus: int) -> JobSpec:
    return JobSpec.from_flat({"progress": "none", **settings, "model": args.model, "backend": "null",
                              "inputs": [str(path)], "output_dir": str(work / "out"), "ignore_eos": True,
                              "restart": True, "data_parallel_size": num_gpus,
                              "engines_per_gpu": args.engines_per_gpu}, source="benchmarks/coordinator.py")


def _line(r: dict) -> str:
    return (f"{r['shape']:<14} K={r['num_engines']:<3} {r['rows']:>7,} rows  {r['rows_per_s']:>8,.0f} rows/s  "
            f"{r['prompt_tok_per_s']:>10,} prompt tok/s  {r['output_tok_per_s']:>10,} output tok/s  "
            f"gen {r['generate_s']:6.1f}s wall {r['wall_s']:6.1f}s  cpu {r['cpu_ms_per_row']:.3f} ms/row, "
            f"{r['python_cpu_ms_per_row']:.3f} in Python threads, {r['scan_cpu_ms_per_row']:.3f} of it the pre-scan "
            f"(tokenizer alone {r['tokenizer_cpu_ms_per_row']:.3f})  "
            f"wire {r['bytes_out_per_row']:,} B/row out, {r['bytes_in_per_row']:,} in, "
            f"{r['messages_per_chunk']} msg/chunk, {r['num_chunks']} chunks, {r['num_parts']} parts")


if __name__ == "__main__":
    main()
