"""One bucket of an object store: list, read and write whole objects, and the conditional writes that the
output's lock relies on (`If-None-Match: *`: create only; `If-Match: ETAG`: replace only that version).

s3:// and gs:// go through obstore (the `s3` extra; why obstore: docs/guides/object-storage.md, measured),
credentials as the SDKs read them: the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE through boto3 when it is
installed, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS), never a command line. hf:// (inputs only) goes
through huggingface_hub's file system (HF_TOKEN). Every failure of the store becomes a StorageError that
says what failed on which URL and how to fix it, in the store's words cut to one line: never a credential.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qbatch._fs import atomic_write
from qbatch.errors import StorageError
from qbatch.storage.urls import Url

COPY_BLOCK_BYTES = 8 << 20  # a download holds about one block in memory, whatever the object's size
LIBRARIES = {"s3": ("obstore", "s3"), "gs": ("obstore", "s3"), "hf": ("huggingface_hub", "hf")}
CREDENTIALS_HINT = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, with boto3 installed), and "
          "AWS_ENDPOINT_URL for a store other than AWS",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file",
    "hf": "set HF_TOKEN, or run `hf auth login`",
}


@dataclass(frozen=True)
class ObjectInfo:
    """An object as listed: its URL, size in bytes and ETag (the store's version of its content)."""

    url: Url
    size: int
    etag: str | None


class Store:
    """The objects of one bucket (s3, gs) or one Hugging Face repository (hf, read only)."""

    def __init__(self, url: Url):
        self.scheme, self.bucket = url.scheme, url.bucket
        self._store = _open(url)
        self.bytes_read = 0  # object bytes this Store downloaded or read in ranges (logged, measured)

    # -- listing -------------------------------------------------------------
    def info(self, url: Url) -> ObjectInfo | None:
        """The object at `url`; None when there is none."""
        with self.errors("read", url):
            try:
                if self.scheme == "hf":
                    return _hf_info(self._store.info(url.path))
                return self._info(self._obstore().head(self._store, url.key))
            except FileNotFoundError:
                return None

    def walk(self, folder: Url) -> list[ObjectInfo]:
        """Every object below `folder`, sorted by URL."""
        with self.errors("list", folder):
            if self.scheme == "hf":
                found = self._store.find(folder.path, detail=True).values()
                return sorted((_hf_info(o) for o in found if o.get("type") == "file"), key=lambda o: o.url.path)
            prefix = folder.key + "/" if folder.key else None
            batches = self._obstore().list(self._store, prefix=prefix, chunk_size=1000)
            return sorted((self._info(meta) for batch in batches for meta in batch), key=lambda o: o.url.path)

    # -- whole objects -------------------------------------------------------
    def download(self, url: Url, path: Path) -> None:
        """The object's bytes into `path` (atomic: whole or absent), streamed a block at a time."""
        def write(tmp: Path) -> None:
            with self.errors("read", url), open(tmp, "wb") as copy:
                if self.scheme == "hf":
                    with self._store.open(url.path, "rb", block_size=COPY_BLOCK_BYTES) as source:
                        while block := source.read(COPY_BLOCK_BYTES):
                            copy.write(block)
                    return
                for chunk in self._obstore().get(self._store, url.key).stream(min_chunk_size=COPY_BLOCK_BYTES):
                    copy.write(chunk)
                    self.bytes_read += len(chunk)

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write)

    def ranges(self, found: ObjectInfo) -> RangeReader:
        """The object `found` as a read-only file that fetches each read's byte range (a GET with `Range`),
        for a reader that seeks to the little it needs (a Parquet footer and one column's pages)."""
        return RangeReader(self, found)

    def upload(self, path: Path, url: Url) -> str:
        """`path` as the object `url`, its ETag: one PUT (a multipart upload for a large file, which the
        store shows only once it is complete), so a reader sees the whole object or none."""
        with self.errors("write", url):
            return str(self._obstore().put(self._store, url.key, path)["e_tag"])

    def delete(self, url: Url) -> None:
        """Remove the object `url` (none there: nothing to do)."""
        with self.errors("delete", url):
            self._obstore().delete(self._store, url.key)

    def read(self, url: Url) -> tuple[bytes, str] | None:
        """A small object's bytes and ETag; None when there is none."""
        with self.errors("read", url):
            try:
                got = self._obstore().get(self._store, url.key)
            except FileNotFoundError:
                return None
            return bytes(got.bytes()), str(got.meta["e_tag"])

    # -- conditional writes -----------------------------------------------------
    def create(self, url: Url, data: bytes) -> str | None:
        """Write `data` as `url` only if no object is there (`If-None-Match: *`); its ETag, None when one was."""
        return self._put(url, data, "create")

    def replace(self, url: Url, data: bytes, etag: str) -> str | None:
        """Write `data` over `url` only if its ETag is still `etag` (`If-Match`); the new ETag, None when
        another writer changed or removed it since."""
        return self._put(url, data, {"e_tag": etag})

    def _put(self, url: Url, data: bytes, mode: Any) -> str | None:
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            with self.errors("write", url):
                return str(self._obstore().put(self._store, url.key, data, mode=mode)["e_tag"])
        except (AlreadyExistsError, PreconditionError, FileNotFoundError) as exc:
            if isinstance(exc, FileNotFoundError) and mode == "create":
                raise  # no bucket: errors() said so
            return None

    # -- errors ----------------------------------------------------------------
    @contextmanager
    def errors(self, what: str, url: Url) -> Iterator[None]:
        """The store's failures as StorageErrors naming `url`; a missing object (FileNotFoundError) and a
        failed condition pass, for the caller to read."""
        try:
            yield
        except StorageError:
            raise
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc) or "does not exist" in _reason(exc).lower() and "bucket" in str(exc).lower():
                raise storage_error(what, url, exc) from None
            raise
        except Exception as exc:
            if type(exc).__name__ in ("AlreadyExistsError", "PreconditionError"):
                raise
            raise storage_error(what, url, exc) from None

    def _info(self, meta: dict[str, Any]) -> ObjectInfo:
        return ObjectInfo(Url(self.scheme, f"{self.bucket}/{meta['path']}"), int(meta["size"]), meta.get("e_tag"))

    @staticmethod
    def _obstore() -> Any:
        import obstore

        return obstore


class RangeReader(io.RawIOBase):
    """An object read by byte ranges (Store.ranges): read(n) is one ranged GET of n bytes from the position."""

    def __init__(self, store: Store, found: ObjectInfo):
        super().__init__()
        self.store, self.found, self._pos = store, found, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.found.size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self.found.size if size is None or size < 0 else min(self.found.size, self._pos + size)
        if end <= self._pos:
            return b""
        with self.store.errors("read", self.found.url):
            data = bytes(self.store._obstore().get_range(self.store._store, self.found.url.key, start=self._pos,
                                                          end=end))
        self.store.bytes_read += len(data)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def storage_error(what: str, url: Url, exc: BaseException) -> StorageError:
    """'cannot WHAT URL: <the store's reason>' with the fix for that reason."""
    text, name = str(exc), type(exc).__name__
    code = _code(text)
    if name == "UnauthenticatedError" or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                                                   "InvalidToken") or "169.254.169.254" in text:
        # no credentials: obstore asks the cloud's metadata service, which is not there
        reason = "no credentials found" if "169.254.169.254" in text else _reason(exc)
        hint = f"the store refused the credentials or found none: {CREDENTIALS_HINT.get(url.scheme, '')}"
    elif name == "PermissionDeniedError" or code in ("AccessDenied", "AllAccessDisabled"):
        reason, hint = _reason(exc), "these credentials may not do this: check the bucket's policy, or use other credentials"
    elif code == "NoSuchBucket":
        reason = "no such bucket"
        hint = f"check the bucket's name {url.bucket!r} (and AWS_ENDPOINT_URL or the region for a store other than AWS)"
    elif "error sending request" in text or "Connection refused" in text or "dns error" in text:
        reason, hint = "the store cannot be reached", "check the network and AWS_ENDPOINT_URL"
    else:
        reason, hint = _reason(exc), "check the URL and the credentials"
    return StorageError(f"cannot {what} {url}: {reason}", hint=hint)


def _code(text: str) -> str:
    found = re.search(r"<Code>([^<]+)</Code>", text)
    return found.group(1) if found else ""


def _reason(exc: BaseException) -> str:
    """The store's words in one line: its XML <Message> when it sent one, else the error's first line (never
    the request it dumps below, which names headers)."""
    text = str(exc)
    found = re.search(r"<Message>([^<]+)</Message>", text)
    if found:
        return found.group(1)
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line.split(": Error performing")[0][:300]


def _open(url: Url) -> Any:
    library, extra = LIBRARIES[url.scheme]
    try:
        __import__(library)
    except ImportError:
        raise StorageError(f"{url.scheme}:// needs {library}, which is not installed",
                           hint=f"pip install 'qbatch[{extra}]'") from None
    if url.scheme == "hf":
        from huggingface_hub import HfFileSystem

        return HfFileSystem()
    from obstore.store import from_url

    options: dict[str, Any] = {}
    if url.scheme == "s3":
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            options["client_options"] = {"allow_http": True}  # a local store (MinIO, moto) without TLS
        session = _boto3_session() if "AWS_ACCESS_KEY_ID" not in os.environ else None
        if session is not None:
            from obstore.auth.boto3 import Boto3CredentialProvider

            options["credential_provider"] = Boto3CredentialProvider(session)  # AWS_PROFILE, SSO, config files
    return from_url(f"{url.scheme}://{url.bucket}", **options)


def _boto3_session() -> Any:
    """boto3's session where it is installed and finds credentials (a profile, SSO, a role), else None:
    obstore reads the environment and the cloud's metadata service itself."""
    try:
        import boto3
    except ImportError:
        return None
    session = boto3.Session()
    return session if session.get_credentials() is not None else None


def _hf_info(found: dict[str, Any]) -> ObjectInfo:
    etag = (found.get("lfs") or {}).get("sha256") or found.get("blob_id")
    return ObjectInfo(Url("hf", str(found["name"]).strip("/")), int(found.get("size") or 0), etag)
