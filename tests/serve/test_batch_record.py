"""The service's batches and files as records (serve/objects.py): a batch's JSON keeps OpenAI's keys in
their order (what the store held before the record reads back the same), and an ended batch never changes."""

import openai.types

from qbatch.serve.objects import Batch, RequestCounts, StoredFile, new_batch
from qbatch.serve.store import Store

# A batch object as the store held it before the record: the service's JSON, OpenAI's keys in OpenAI's order
STORED_BEFORE = {"id": "batch_" + "0" * 24, "object": "batch", "endpoint": "/v1/chat/completions", "model": "m",
                 "errors": None, "input_file_id": "file-" + "1" * 24, "completion_window": "24h",
                 "status": "in_progress", "output_file_id": None, "error_file_id": None, "created_at": 100,
                 "in_progress_at": 101, "expires_at": 86500, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 2, "completed": 0, "failed": 0}, "metadata": None,
                 "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                           "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}}


def test_a_batch_stored_before_the_record_reads_back_key_for_key():
    batch = Batch.load(STORED_BEFORE)
    assert batch.request_counts == RequestCounts(total=2) and batch.status == "in_progress"
    assert list(batch.save().items()) == list(STORED_BEFORE.items())
    assert list(new_batch("file-" + "1" * 24, "/v1/completions", "24h", 60.0, None, "m").save()) == list(STORED_BEFORE)
    openai.types.Batch.model_validate(batch.save())


def test_an_ended_batch_keeps_its_status_and_hands_out_no_files(tmp_path):
    store = Store(tmp_path / "s.sqlite3")
    batch = Batch.load(STORED_BEFORE)
    store.add_batch(batch)
    done = store.update_batch(batch.id, lambda b: b.changed("completed"))
    assert done.status == "completed" and done.completed_at is not None
    output = StoredFile("file-" + "2" * 24, "batch_output", "out.jsonl", 3, 1, str(tmp_path / "o"), 1)
    again = store.update_batch(batch.id, lambda b: b.changed("cancelled"), new_files=[output])
    assert again == done and store.file(output.id) is None
    store.close()
