"""Prefix-aware order (jobs/prefixes.py, chunking.order_groups, cut_group_chunks): seeded random windows
of documents asked several questions, scattered, with a system prompt every row shares."""

import random

import pytest

from qbatch.jobs.chunking import cut_group_chunks, length_key, order_groups, sort_window
from qbatch.jobs.prefixes import prefix_labels
from qbatch.records import Request

SYSTEM = list(range(1000, 1300))  # 300 tokens every row starts with: no group of its own


def window(rng: random.Random, docs: int, singles: int, *, system: list[int] = SYSTEM) -> list[Request]:
    """`docs` documents of 150-700 tokens with 1-6 questions each, plus `singles` rows of their own, shuffled."""
    rows = []
    for d in range(docs):
        body = [rng.randrange(5000, 60000) for _ in range(rng.randrange(150, 700))]
        for q in range(rng.randrange(1, 7)):
            question = [rng.randrange(5000, 60000) for _ in range(rng.randrange(5, 40))]
            rows.append(Request(f"d{d}q{q}", 0, len(rows), system + body + question,
                                {"max_tokens": rng.choice([8, 8, 64, 256])}, None))
    for s in range(singles):
        own = [rng.randrange(5000, 60000) for _ in range(rng.randrange(1, 900))]
        rows.append(Request(f"s{s}", 0, len(rows), system + own, {"max_tokens": rng.choice([8, 64])}, None))
    rng.shuffle(rows)
    return rows


def doc(request: Request) -> str:
    return request.id.split("q")[0] if request.id.startswith("d") else request.id


@pytest.mark.parametrize("seed", range(20))
def test_groups_hold_every_row_once_contiguous_and_sorted(seed):
    rng = random.Random(seed)
    rows = window(rng, docs=rng.randrange(0, 60), singles=rng.randrange(0, 60))
    groups = order_groups(rows, "longest-first")
    flat = [r for g in groups for r in g]
    assert sorted(r.id for r in flat) == sorted(r.id for r in rows)  # every row exactly once
    for group in groups:
        assert [length_key(r) for r in group] == sorted((length_key(r) for r in group), reverse=True)
        assert len({doc(r) for r in group}) == 1  # a group is one document (or one row)
    # a document's questions are one group (a depth falls inside each document: 128-token steps)
    of_doc: dict[str, set[int]] = {}
    for i, group in enumerate(groups):
        for r in group:
            of_doc.setdefault(doc(r), set()).add(i)
    assert all(len(indexes) == 1 for indexes in of_doc.values())
    # groups by their longest row: the length sort holds between groups' heads
    heads = [length_key(g[0]) for g in groups]
    assert heads == sorted(heads, reverse=True)


@pytest.mark.parametrize("seed", range(20))
def test_chunks_never_split_a_group_that_fits(seed):
    rng = random.Random(seed)
    rows = window(rng, docs=40, singles=30)
    budget = rng.choice([800, 2000, 5000, 20000])
    groups = order_groups(rows, "longest-first")
    chunks = list(cut_group_chunks(groups, budget))
    assert [r.id for c in chunks for r in c] == [r.id for g in groups for r in g]  # order kept, each row once
    chunk_of = {r.id: i for i, c in enumerate(chunks) for r in c}
    for group in groups:
        cost = sum(r.cost for r in group)
        if cost <= budget:
            assert len({chunk_of[r.id] for r in group}) == 1
    for chunk in chunks:  # over the budget only when one group alone is
        if sum(r.cost for r in chunk) > budget:
            assert len(chunk) == 1 or len({doc(r) for r in chunk}) == 1


def test_a_split_group_cut_by_budget_and_its_tail_starts_the_next_chunk():
    rows = [Request(f"d0q{i}", 0, i, SYSTEM + list(range(200)) + [i], {"max_tokens": 100}, None) for i in range(5)]
    rows.append(Request("s0", 0, 9, [7] * 50, {"max_tokens": 10}, None))  # cost 60
    chunks = list(cut_group_chunks(order_groups(rows, "longest-first"), 1300))  # each doc row costs 601
    assert [[r.id for r in c] for c in chunks] == [["d0q0", "d0q1"], ["d0q2", "d0q3"], ["d0q4", "s0"]]


def test_without_shared_prefixes_the_order_is_the_flat_sort():
    rng = random.Random(7)
    rows = window(rng, docs=0, singles=200, system=[])
    assert [r.id for g in order_groups(rows, "longest-first") for r in g] == [r.id for r in sort_window(rows)]
    assert order_groups(rows, "longest-first-flat") == [[r] for r in sort_window(rows)]
    assert order_groups(rows, "input") == [[r] for r in rows]


def test_a_prefix_shared_by_very_many_rows_makes_no_group():
    """A system prompt every row has (more rows than MAX_GROUP_ROWS) is no group; documents under it are."""
    rows = [Request(str(i), 0, i, SYSTEM + [i % 50] * 200 + [i], {"max_tokens": 8}, None) for i in range(300)]
    labels = prefix_labels([r.prompt_token_ids for r in rows])
    assert len(set(labels)) == 50 and None not in labels  # 50 documents of 6 rows
    assert prefix_labels([r.prompt_token_ids for r in rows], max_group_rows=5) == [None] * 300  # each document now too common: no groups
    short = [Request(str(i), 0, i, [1] * 100 + [i], {"max_tokens": 8}, None) for i in range(4)]
    assert prefix_labels([r.prompt_token_ids for r in short]) == [None] * 4  # 100 shared tokens: under the shallowest depth


def test_grouping_a_large_window_is_fast():
    """8,192 rows of ~1,500 tokens (the default sort window): well under a second of the planner's thread."""
    import time

    rng = random.Random(3)
    docs = [[rng.randrange(5000, 60000) for _ in range(1500)] for _ in range(2048)]
    rows = [Request(str(i), 0, i, SYSTEM + docs[i % 2048] + [i], {"max_tokens": 8}, None) for i in range(8192)]
    rng.shuffle(rows)
    started = time.perf_counter()
    groups = order_groups(rows, "longest-first")
    elapsed = time.perf_counter() - started
    assert len(groups) == 2048 and elapsed < 5  # ~0.3 s measured on a loaded 2-core CI machine


def test_a_runs_plan_keeps_each_documents_questions_together(bundled_model, tmp_path):
    """Through the run's own chunking (chat template, tokenizer, windows, chunks): documents asked three
    questions each, scattered through the file, come out adjacent, in one chunk each."""
    import json

    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "lambda"]
    docs = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(60)]  # one length: the sort mixes them
    rows = [{"id": f"d{d}q{q}", "prompt": f"{docs[d]}\n\nQuestion {q}: what is word {rng.randrange(99)}?"}
            for d in range(60) for q in range(3)]
    rng.shuffle(rows)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"inputs": [str(path)], "model": bundled_model, "max_tokens": 8, "chunk_tokens": 3000}
    chunks = list(Job.setup(JobSpec.from_flat(settings)).work(set()))
    ids = [r.id for chunk in chunks for r in chunk]
    assert sorted(ids) == sorted(r["id"] for r in rows)
    for d in range(60):
        where = [i for i, rid in enumerate(ids) if doc_of(rid) == f"d{d}"]
        assert where == list(range(where[0], where[0] + 3))  # adjacent
        assert len({next(c for c, chunk in enumerate(chunks) if ids[i] in {r.id for r in chunk}) for i in where}) == 1
    flat = list(Job.setup(JobSpec.from_flat({**settings, "order": "longest-first-flat"})).work(set()))
    flat_ids = [r.id for chunk in flat for r in chunk]
    # without groups, fewer than half the 120 neighbours a grouped plan has are of one document (36 here)
    assert sum(doc_of(a) == doc_of(b) for a, b in zip(flat_ids, flat_ids[1:])) < 60


def doc_of(rid: str) -> str:
    return rid.split("q")[0]


def window_sizes(bundled_model: str, rows: list[dict], path) -> list[int]:
    import json

    from qbatch.jobs.job import Job
    from qbatch.spec import JobSpec

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "max_tokens": 8,
                                       "sort_window": 2048}))
    with job.windows(set()) as windows:
        return [sum(len(chunk) for chunk in window.chunks) for window in windows]


def test_rows_sharing_documents_get_whole_windows_from_the_start(bundled_model, tmp_path):
    """Windows grow from 64 rows, which would spread a document's scattered questions over several
    windows; rows that share documents (seen in the first 512 rows' texts) get a whole sort window
    from the first row on."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "lambda"]
    docs = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(200)]
    asked = [{"id": f"d{d}q{q}", "prompt": f"{docs[d]}\n\nQuestion {q}?"} for d in range(200) for q in range(10)]
    rng.shuffle(asked)
    assert window_sizes(bundled_model, asked, tmp_path / "docs.jsonl") == [2000]  # one window (up to 2,048)
    plain = [{"id": f"r{i}", "prompt": " ".join(rng.choice(words) for _ in range(200))} for i in range(2000)]
    assert window_sizes(bundled_model, plain, tmp_path / "plain.jsonl") == [64, 128, 256, 512, 1040]  # 64, ..., 1,024 + the tail


def test_rows_that_travel_as_text_group_as_their_token_ids_do(bundled_model, tmp_path):
    """A generated row travels as its text (records.PromptText) and is grouped on it (CHARS_PER_TOKEN x the
    depths): the same documents as grouping the same rows' token ids, with a system prompt every row has."""
    import copy
    import json

    from qbatch.jobs.job import Job
    from qbatch.jobs.prefixes import grouped
    from qbatch.records import PromptText
    from qbatch.spec import JobSpec
    from qbatch.tokens import encode_prompts

    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "lambda", "and", "the"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(200, 900))) for _ in range(40)]
    rows = [{"id": f"d{d}q{q}", "prompt": f"{docs[d]}\n\nQuestion {q}: what is word {rng.randrange(99)}?"}
            for d in range(40) for q in range(rng.randrange(1, 5))]
    rows += [{"id": f"s{i}", "prompt": " ".join(rng.choice(words) for _ in range(300))} for i in range(30)]
    rng.shuffle(rows)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = Job.setup(JobSpec.from_flat({"inputs": [str(path)], "model": bundled_model, "max_tokens": 8,
                                       "system_prompt": "You answer questions about documents. " * 20}))
    requests, failures = job.preparer.prepare(list(job.identified_rows(set())))
    assert not failures and all(isinstance(r.tokens, PromptText) for r in requests)
    as_ids = copy.deepcopy(requests)
    encode_prompts(as_ids, job.preparer.encoder)
    assert all(isinstance(r.tokens, list) for r in as_ids)

    def documents(window: list[Request]) -> set[frozenset[str]]:
        return {frozenset(r.id for r in group) for group in grouped(window, length_key) if len(group) > 1}

    by_text = documents(requests)
    assert by_text == documents(as_ids)
    assert by_text == {frozenset(r["id"] for r in rows if doc_of(r["id"]) == f"d{d}")
                       for d in range(40) if sum(doc_of(r["id"]) == f"d{d}" for r in rows) > 1}
