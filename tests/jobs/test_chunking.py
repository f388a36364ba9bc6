import json

from qbatch.jobs.chunking import cut_chunks, sort_window
from qbatch.records import Request


def req(n_prompt: int, max_tokens: int = 10, rid: str = "x") -> Request:
    return Request(rid, 0, 0, list(range(n_prompt)), {"max_tokens": max_tokens}, None)


def test_sort_window_longest_prompt_first():
    out = sort_window([req(3), req(9), req(5)])
    assert [r.num_prompt_tokens for r in out] == [9, 5, 3]


def test_sort_window_most_output_first_then_longest_prompt():
    out = sort_window([req(9, 8), req(3, 500), req(5, 8), req(1, 64)])
    assert [(r.sampling["max_tokens"], r.num_prompt_tokens) for r in out] == [(500, 3), (64, 1), (8, 9), (8, 5)]


def test_cut_chunks_respects_token_budget():
    requests = [req(10, 10, str(i)) for i in range(10)]  # cost 20 each
    chunks = list(cut_chunks(requests, 60))
    assert [len(c) for c in chunks] == [3, 3, 3, 1]
    assert all(sum(r.cost for r in c) <= 60 for c in chunks)
    assert [r.id for c in chunks for r in c] == [str(i) for i in range(10)]


def test_oversized_request_gets_its_own_chunk():
    chunks = list(cut_chunks([req(5), req(500), req(5)], 100))
    assert [len(c) for c in chunks] == [1, 1, 1]


def test_windows_grow_and_sort_only_within_themselves(bundled_model, tmp_path, monkeypatch):
    """The run's own chunking: windows of 2 rows, then doubling up to --sort-window (4), each sorted;
    the rows left at the end (2) are sorted with the last full window, not after it."""
    from qbatch.jobs import job
    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    monkeypatch.setattr(job, "FIRST_WINDOW", 2)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": str(n), "prompt": "word " * n}) + "\n" for n in range(1, 9)))
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "sort_window": 4})
    with Job.setup(spec).windows(set()) as windows:
        assert [[r.id for r in chunk] for window in windows for chunk in window.chunks] == \
            [["2", "1"], ["8", "7", "6", "5", "4", "3"]]  # one chunk per window (a large token budget)
    spec = JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "sort_window": 4, "chunk_tokens": 1})
    chunks = [[r.id for r in chunk] for chunk in Job.setup(spec).work(set())]
    assert chunks == [[str(n)] for n in (2, 1, 8, 7, 6, 5, 4, 3)]  # a chunk per row, in the windows' order


def test_the_order_simulation_plans_as_the_run_does_and_the_merged_last_window_wins():
    """benchmarks/simulate_order.py, the model behind the merged last window, stays runnable and true to it."""
    import importlib.util
    from pathlib import Path

    from qbatch.bench.workloads import sample_lengths

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_order.py"
    spec = importlib.util.spec_from_file_location("simulate_order", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    assert sim.windows(1600, merge_last=True) == [64, 128, 256, 1152]  # what the run does (test_pipeline_null)
    assert sim.windows(4096, merge_last=False) == [64, 128, 256, 512, 1024, 2048, 64]
    rows = sample_lengths("varied", 4096, seed=1)
    best = sim.simulate(sim.longest_first(rows))
    merged = sim.simulate(sim.planned(rows, sim.windows(4096, merge_last=True)))
    before = sim.simulate(sim.planned(rows, sim.windows(4096, merge_last=False)))
    assert merged <= best * 1.005 and before > merged * 1.05
