"""Issue #57's shared-document job on a GPU: raw best, then `qbatch run` of several commits, on one file.

    python benchmarks/docqa_commits.py MODEL_DIR WORK_DIR NAME=QBATCH_TREE... [--rows 9000] [--workload docqa-shared]

The workload (`qbatch bench docqa-shared`: 1,500 documents of ~1,500 tokens, six questions each,
rows scattered, 24 tokens out) is written once; raw best (`qbatch bench --modes vllm-best`: one
engine, performance_mode=throughput, token ids, one generate) runs on it; then each NAME's qbatch
(a tree holding its `qbatch` package, e.g. `git archive d8cbba8 qbatch | tar x -C old/d8cbba8`) runs
`qbatch run FILE --ignore-eos` at its defaults, as the bench's qbatch mode does. For each: total
tok/s over the generate time (stats.json), the cached share of prompt tokens, and each engine's
cached share from telemetry.parquet (its last sample of each engine). Each run's log (its phases, timed) is
WORK_DIR/NAME.out. Dummy weights. Prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def opt(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def per_engine(folder: Path) -> dict:
    import polars as pl

    path = folder / "telemetry.parquet"
    if not path.exists():
        return {}
    df = pl.read_parquet(path).filter(pl.col("prompt_tokens").is_not_null())
    df = df.filter(pl.col("source") == "engine")  # one engine a device label ("worker 0 (device 0)", ...)
    last = df.group_by("device").agg(pl.col("prompt_tokens").max(), pl.col("cached_tokens").max())
    return {row["device"]: {"prompt_tokens": row["prompt_tokens"], "cached_share": round(row["cached_tokens"] / max(row["prompt_tokens"], 1), 4)}
            for row in last.iter_rows(named=True)}


def main() -> None:
    args = sys.argv[1:]
    model, work = args[0], Path(args[1])
    trees = [a for a in args[2:] if "=" in a and not a.startswith("--")]
    rows, workload = opt(args, "--rows", "9000"), opt(args, "--workload", "docqa-shared")
    work.mkdir(parents=True, exist_ok=True)
    here = os.environ.get("PYTHONPATH", "")
    bench = [sys.executable, "-m", "qbatch.cli", "bench", workload, "--rows", rows, "--model", model,
             "--load-format", "dummy", "--work-dir", str(work)]
    subprocess.run([*bench, "--inputs-only"], check=True, stdout=subprocess.DEVNULL)
    report: dict = {"workload": workload, "rows": int(rows)}
    t0 = time.monotonic()
    subprocess.run([*bench, "--modes", "vllm-best", "--json", str(work / "best.json")], check=True,
                   stdout=open(work / "best.out", "w"), stderr=subprocess.STDOUT)
    best = json.loads((work / "best.json").read_text())
    report["raw_best"] = {"runs": best.get("results", best), "wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(report), flush=True)
    for name, tree in (t.split("=", 1) for t in trees):
        out = work / f"out-{name}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(tree).resolve()), here) if p)}
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "qbatch.cli", "run", str(work / f"{workload}.jsonl"), "-o", str(out),
                               "--model", model, "--load-format", "dummy", "--ignore-eos", "--progress", "log"],
                              env=env, stdout=open(work / f"{name}.out", "w"), stderr=subprocess.STDOUT)
        wall = time.monotonic() - t0
        entry: dict = {"exit": done.returncode, "wall_s": round(wall, 1)}
        if (out / "stats.json").exists():
            s = json.loads((out / "stats.json").read_text())
            entry.update({k: s.get(k) for k in ("generate_s", "engine_start_s", "setup_s", "engine_choice", "num_chunks",
                                                "prompt_tokens", "completion_tokens", "cached_tokens")})
            entry["total_tok_s"] = round((s["prompt_tokens"] + s["completion_tokens"]) / max(s["generate_s"], 1e-9))
            entry["cached_share"] = round(s["cached_tokens"] / max(s["prompt_tokens"], 1), 4)
            entry["per_engine"] = per_engine(out)
        report[name] = entry
        print(json.dumps(report), flush=True)
    (work / "docqa.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
