"""The --server wire's last line (wire.RunEnd): the run's Summary as the service sends it and a client
reads it back, a newer service's summary fields left out rather than failing the client."""

import dataclasses

from qbatch.output.summary import Summary
from qbatch.serve.wire import RunEnd


def test_a_run_end_reads_back_as_it_was_sent():
    summary = Summary("/out", "completed", rows_ok=3, flags={"cut": 1}, chunks=[{"index": 0, "rows": 3}])
    line = RunEnd(summary, 2).save()
    assert line["summary"] == dataclasses.asdict(summary) and line["exit_code"] == 2
    assert RunEnd.load(line) == RunEnd(summary, 2)


def test_a_newer_services_summary_fields_are_left_out():
    line = RunEnd(Summary("/out", "completed", rows_ok=3), 0).save()
    line["summary"]["gpu_seconds"] = 1.5  # a field this client's Summary does not have
    assert RunEnd.load(line).summary.rows_ok == 3


def test_stats_json_reads_back_without_its_rates():
    summary = Summary("/out", "completed", rows_ok=4, completion_tokens=40, generate_s=2.0)
    stats = summary.save()
    assert stats["output_tok_s"] == 20.0 and "plan" not in stats
    assert Summary.load(stats) == summary


def test_a_dry_runs_plan_crosses_the_wire():
    """`qbatch run --server --dry-run` prints the plan the service made: the summary's plan is read back."""
    line = RunEnd(Summary(None, "dry-run", plan="1 engine on cpu"), 0).save()
    assert RunEnd.load(line).summary.plan == "1 engine on cpu"
