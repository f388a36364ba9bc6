"""The yardstick (issue #53.11): a roofline from the model's size, the KV cache each output token reads and
the GPU's peaks; checked against the H200 runs of docs/benchmarks.md (every measured run below its
roofline), and the dry run's estimate from this machine's earlier runs."""

from __future__ import annotations

import json

import pytest

from qbatch.bench.workloads import sample_lengths
from qbatch.plan.roofline import ModelCost, Work, gpu_peak, roofline

QWEN3_06B = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "hidden_size": 1024}
WEIGHTS = 1_191_968_768  # Qwen3-0.6B's bf16 weights (tied embeddings)


def test_a_qwen3_token_of_context_holds_112_kib_of_kv_cache():
    cost = ModelCost.of_config(QWEN3_06B, WEIGHTS)
    assert cost.kv_bytes_per_token == 112 * 1024 and cost.params == WEIGHTS // 2
    assert gpu_peak("NVIDIA H200").bandwidth == 4.8e12 and gpu_peak("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert gpu_peak(None) is None and gpu_peak("Tesla T4") is None


# (workload, rows, measured tok/s on one H200, "output" or "total" tok/s): docs/benchmarks.md, session 50's table
H200_RUNS = [("varied", 4096, 38_972, "output"), ("longgen", 1024, 32_300, "output"),
             ("prefill", 8192, 533_000, "total"), ("prefill-short", 16384, 459_000, "total")]


@pytest.mark.parametrize("name,rows,measured,kind", H200_RUNS)
def test_every_h200_run_of_the_benchmarks_is_below_its_roofline(name, rows, measured, kind):
    """A roofline a measured run exceeded would be wrong; one far above every run would say nothing."""
    work = Work.of_rows(sample_lengths(name, rows))
    line = roofline(work, ModelCost.of_config(QWEN3_06B, WEIGHTS), gpu_peak("NVIDIA H200"))
    tokens = work.output_tokens if kind == "output" else work.prompt_tokens + work.output_tokens
    share = measured / (tokens / line.seconds)
    assert 0.3 < share < 1.0, f"{name}: {share:.0%} of the roofline"
    assert line.bound == ("memory" if kind == "output" else "compute")


def test_a_dry_run_estimates_from_this_machines_earlier_runs(run_null, write_jsonl, tmp_path, monkeypatch,
                                                             bundled_model):
    monkeypatch.setenv("QBATCH_CACHE", str(tmp_path / "cache"))
    data = write_jsonl([{"id": f"r{i}", "prompt": f"say {i}"} for i in range(10)])
    result = run_null(data, "--dry-run", "--max-tokens", "100", "--price-per-gpu-hour", "3.6")
    assert "estimated generate time  unknown" in result.stdout
    assert "no GPU figures and no earlier run of this model here: no estimate" in result.stdout
    import os

    cores = len(os.sched_getaffinity(0))
    history = tmp_path / "cache" / "rates.jsonl"
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text("".join(json.dumps({"model": bundled_model, "machine": f"cpu x{cores}", "gpus": 1,
                                           "output_tok_s": rate}) + "\n" for rate in (40, 50, 1000)) + "{cut")
    result = run_null(data, "--dry-run", "--max-tokens", "100", "--price-per-gpu-hour", "3.6")
    assert "estimated generate time  20s" in result.stdout  # 1,000 tokens at the median 50 tok/s
    assert "the median output rate of 3 earlier runs of this model here (50 tok/s)" in result.stdout
    assert "estimated cost           0.0200 (at --price-per-gpu-hour)" in result.stdout


def test_status_and_the_report_show_the_runs_share_of_its_roofline(run_null, cli, write_jsonl, tmp_path):
    """A run on a GPU qbatch has figures for records its roofline in stats.json (the null engine has no GPU:
    the record is written here as a GPU run writes it); `qbatch status` and the report show it, and a
    damaged record is named, never a traceback."""
    out = tmp_path / "out"
    assert run_null(write_jsonl([{"id": "a", "prompt": "hi"}]), "-o", out).exit_code == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["roofline"] is None  # no GPU: no roofline
    stats["roofline"] = {"gpu": "H200", "gpus": 1, "bound": "memory", "seconds": 9.9, "share": 0.45}
    (out / "stats.json").write_text(json.dumps(stats))
    status = cli("status", out)
    assert "of the GPU's roofline  45% (1x H200, memory-bound: 9.9s at best for this work)" in status.output
    assert cli("report", out).exit_code == 0
    page = (out / "report.html").read_text()
    assert "of what this GPU can do for this work" in page and "roofline: 9.9s at best, memory-bound" in page
    stats["roofline"] = "fast"
    (out / "stats.json").write_text(json.dumps(stats))
    damaged = cli("status", out)
    assert damaged.exit_code == 1 and "'roofline' is text, not an object" in damaged.output
