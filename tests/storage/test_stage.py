"""The order in which a staged output folder goes up (storage/stage.py): a new folder's manifest before its
parts, later manifests after the parts they count, removed files removed first; never a lock or a temp file."""

from __future__ import annotations

from qbatch.storage.stage import StagedFolder
from qbatch.storage.urls import Url


def test_uploads_keep_the_manifest_and_parts_in_step(bucket, monkeypatch):
    folder = StagedFolder(Url.parse(f"s3://{bucket}/out"), locked=False).open()
    order: list[str] = []
    upload, delete = folder.store.upload, folder.store.delete
    monkeypatch.setattr(folder.store, "upload", lambda path, url: (order.append(folder.url.relative(url)), upload(path, url))[1])
    monkeypatch.setattr(folder.store, "delete", lambda url: (order.append("-" + folder.url.relative(url)), delete(url))[1])
    try:
        (folder.path / "parts").mkdir()
        (folder.path / "parts" / "part-000001.parquet").write_bytes(b"1")
        (folder.path / "manifest.json").write_text("{}")
        (folder.path / ".qbatch.lock").write_text("pid 1")
        (folder.path / "parts" / "part-000002.parquet.tmp-99").write_bytes(b"half")
        folder.push()
        assert order == ["manifest.json", "parts/part-000001.parquet"]  # the first manifest first

        order.clear()
        (folder.path / "parts" / "part-000002.parquet").write_bytes(b"2")
        (folder.path / "manifest.json").write_text('{"status": "completed"}')
        folder.push()
        assert order == ["parts/part-000002.parquet", "manifest.json"]  # later: the parts it counts first

        order.clear()
        (folder.path / "parts" / "part-000001.parquet").unlink()  # --restart
        folder.push()
        assert order == ["-parts/part-000001.parquet"]
        keys = sorted(o.url.path for o in folder.objects())
        assert keys == [f"{bucket}/out/manifest.json", f"{bucket}/out/parts/part-000002.parquet"]
    finally:
        folder.discard()
