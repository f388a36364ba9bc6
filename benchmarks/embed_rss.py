"""Peak memory of `qbatch embed` on a large corpus, with the null engine (no model runs).

Writes N rows of text to a JSONL file, runs `qbatch embed --backend null` on it in a subprocess
and samples the RSS of its whole process tree (psutil, every 0.2 s), split into the embedding
phase and the assembly of results.parquet. The null engine's vectors have the model's hidden
size: the bundled tokenizer with a config of hidden_size DIMS (Qwen3-0.6B's 1,024 by default).

    python benchmarks/embed_rss.py --rows 100000 --rows 1000000 --work /tmp/embed-rss

Results go to docs/benchmarks.md ("Embeddings").
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def model_folder(work: Path, dims: int) -> Path:
    """The bundled model's tokenizer with a config whose hidden size is `dims` (the null engine's vectors)."""
    sys.path.insert(0, str(ROOT))
    from qbatch.models import registry

    source = Path(registry.resolve("smollm2-135m"))
    folder = work / f"null-model-{dims}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": dims, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": dims // 16}))
    return folder


def write_corpus(path: Path, num_rows: int) -> None:
    rng = random.Random(0)
    words = "the of and to in is that for it as with was on be by this are from at or an have not".split()
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(num_rows):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 120)))
            handle.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def measure(corpus: Path, out: Path, model: Path, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "qbatch.cli", "embed", str(corpus), "-o", str(out), "--model", str(model),
           "--backend", "null", "--prompt-column", "text", "--progress", "none", "--no-telemetry", *extra]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps = psutil.Process(proc.pid)
    samples: list[tuple[float, int, bool]] = []  # (seconds, rss, assembling)
    while proc.poll() is None:
        assembling = _assembling(out)
        samples.append((time.monotonic() - started, tree_rss(ps), assembling))
        time.sleep(0.2)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(output)
    embedding = [rss for _, rss, a in samples if not a]
    assembly = [rss for _, rss, a in samples if a]
    mid = embedding[len(embedding) // 4:] or embedding
    stats = json.loads((out / "stats.json").read_text())
    return {"rows": stats["rows_ok"], "wall_s": round(time.monotonic() - started, 1),
            "generate_s": round(stats["generate_s"], 1), "assemble_s": round(stats["assemble_s"], 1),
            "peak_rss_mb_embedding": round(max(embedding) / 2**20), "rss_mb_quarter_to_end": [
                round(min(mid) / 2**20), round(max(mid) / 2**20)],
            "peak_rss_mb_assembly": round(max(assembly) / 2**20) if assembly else None,
            "rss_mb_timeline": [round(embedding[int(i * (len(embedding) - 1) / 9)] / 2**20) for i in range(10)],
            "results_mb": round((out / "results.parquet").stat().st_size / 2**20)}


def _assembling(out: Path) -> bool:
    """Assembly has begun once results.parquet's temporary file (or the file) exists."""
    return any(out.glob("results.parquet*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", required=True)
    parser.add_argument("--dims", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/embed-rss"))
    parser.add_argument("extra", nargs="*", help="more `qbatch embed` flags")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = model_folder(args.work, args.dims)
    for num_rows in args.rows:
        corpus = args.work / f"corpus-{num_rows}.jsonl"
        if not corpus.exists():
            write_corpus(corpus, num_rows)
        print(json.dumps({"dims": args.dims, **measure(corpus, args.work / f"out-{num_rows}", model, args.extra)}),
              flush=True)


if __name__ == "__main__":
    main()
