"""The run summary the CLI prints: the prefix cache's share of the input tokens, when it served any."""

from __future__ import annotations

from qbatch.display import print_summary
from qbatch.output.summary import Summary


def test_the_summary_says_what_share_of_the_input_the_prefix_cache_served(capsys):
    print_summary(Summary("out", "completed", rows_ok=4, samples_ok=4, prompt_tokens=1000,
                          completion_tokens=40, cached_tokens=736))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("tokens in / out"))
    assert line.endswith("1,000 / 40 (74% of input from the prefix cache)")


def test_no_share_is_printed_without_hits_and_stats_json_keeps_the_count(capsys):
    summary = Summary("out", "completed", rows_ok=4, prompt_tokens=1000, completion_tokens=40)
    print_summary(summary)
    assert "prefix cache" not in capsys.readouterr().out
    assert summary.save()["cached_tokens"] == 0
