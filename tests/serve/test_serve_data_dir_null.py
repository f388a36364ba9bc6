"""One service a data folder: a second `qbatch serve` on it is refused at start (exit 75, as a second run on
an output folder), and a batch that ended never changes again (a failed one never turns `completed`)."""

from __future__ import annotations

import os

import pytest

from qbatch.errors import EXIT_LOCKED, LockedError
from tests.serve.conftest import client_for, free_port, requests_jsonl, run_to_end


def test_a_second_service_on_the_data_folder_is_refused_at_start(make_service, cli, bundled_model):
    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import Service

    _, first = make_service()
    data_dir = first.settings.data_dir
    with pytest.raises(LockedError) as locked:
        Service(ServeSettings(data_dir, {"model": bundled_model, "backend": "null"}, port=free_port()))
    assert locked.value.exit_code == EXIT_LOCKED == 75
    assert str(locked.value) == (f"another qbatch serve is using this data folder (pid {os.getpid()} since "
                                 f"{locked.value.message.split(' since ')[1]} ({data_dir})")
    assert locked.value.hint == "stop it first, or pass another --data-dir"

    second = cli("serve", "--data-dir", data_dir, "--model", bundled_model, "--backend", "null",
                 "--port", free_port())
    assert second.exit_code == 75, second.output
    assert f"Error: another qbatch serve is using this data folder (pid {os.getpid()} since " in second.stderr
    assert f"({data_dir})\nHint: stop it first, or pass another --data-dir" in second.stderr


def test_a_batch_that_ended_never_changes_again(make_service):
    """The state machine: a failed batch stays failed, its error file as handed out; `completed` never carries
    an error."""
    base_url, service = make_service()
    client = client_for(base_url)
    batch = run_to_end(client, requests_jsonl(3))
    assert batch.status == "completed" and batch.errors is None
    worker = service.worker
    worker._fail(batch.id, "run_failed", "the batch could not run (LockedError)")  # a late failure: refused too
    assert client.batches.retrieve(batch.id).status == "completed"

    failed = client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/chat/completions",
                                   completion_window="24h")
    worker.stop()  # the queue stays: this batch is failed by hand, as a run that failed would
    worker.join(30)
    worker._fail(failed.id, "run_failed", "the batch could not run (LockedError)")
    ended = client.batches.retrieve(failed.id)
    assert ended.status == "failed" and ended.errors.data[0].code == "run_failed"
    handed_out = ended.output_file_id or ended.error_file_id  # what its run finished, or batch_failed lines
    content = client.files.content(handed_out).text
    worker._finalize(service.store.batch(failed.id), "completed")  # what a second worker would have done
    again = client.batches.retrieve(failed.id)
    assert again.status == "failed" and again.completed_at is None and again.errors.data[0].code == "run_failed"
    assert (again.output_file_id or again.error_file_id) == handed_out
    assert client.files.content(handed_out).text == content


def test_the_data_folder_is_made_private_only_when_it_is_the_services(tmp_path, bundled_model):
    """A new data folder, or one the service made before, is made 0700; a folder open to others that holds
    something else (a home, a project) is refused, never changed."""
    import stat

    from qbatch.errors import SpecError
    from qbatch.serve.config import ServeSettings
    from qbatch.serve.server import Service

    engine = {"model": bundled_model, "backend": "null"}
    earlier = tmp_path / "earlier"
    Service(ServeSettings(earlier, engine, port=free_port())).close()
    earlier.chmod(0o755)
    Service(ServeSettings(earlier, engine, port=free_port())).close()
    assert stat.S_IMODE(earlier.stat().st_mode) == 0o700

    project = tmp_path / "project"
    project.mkdir(mode=0o755)
    (project / "notes.txt").write_text("mine")
    with pytest.raises(SpecError) as refused:
        Service(ServeSettings(project, engine, port=free_port()))
    assert str(refused.value) == (f"the data folder holds other files and is open to other users (mode 0755): it "
                                  f"would hold every client's batches ({project})")
    assert refused.value.hint == "pass a new --data-dir (the service makes it), or chmod 700 this one"
    assert stat.S_IMODE(project.stat().st_mode) == 0o755 and sorted(p.name for p in project.iterdir()) == ["notes.txt"]
