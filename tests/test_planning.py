from qbatch.planning import batched, cut_chunks, plan, sort_window
from qbatch.records import Request


def req(n_prompt: int, max_tokens: int = 10, rid: str = "x") -> Request:
    return Request(rid, 0, 0, list(range(n_prompt)), {"max_tokens": max_tokens}, None)


def test_batched_splits_and_keeps_remainder():
    assert list(batched(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]


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


def test_plan_sorts_within_windows_only():
    requests = [req(n, rid=str(n)) for n in (1, 2, 3, 10, 20, 30)]
    chunks = list(plan(requests, window=3, chunk_tokens=10_000))
    assert [[r.id for r in c] for c in chunks] == [["3", "2", "1"], ["30", "20", "10"]]
