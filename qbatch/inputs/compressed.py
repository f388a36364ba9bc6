"""Opening an input file as bytes: plain, gzip (.gz) or zstd (.zst), decompressed as it is read.

A compressed file cut short (a copy or a download that did not finish) must stop the run: read as
far as it goes, it would look like a complete file with fewer rows. gzip says so itself at its end;
zstd's stream reader ends quietly, so a zstd file is read frame by frame and must end where a frame does.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import IO, Any

from qbatch.errors import InputError

READ_BYTES = 1 << 20
CUT_SHORT = "the file is cut short"


def open_input(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed by its suffix; InputError for a folder or a file that cannot be opened."""
    name = path.name.lower()
    try:
        raw = open(path, "rb")
    except IsADirectoryError:
        raise InputError("input is a folder, not a file", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot open input: {exc.strerror}", where=str(path)) from None
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)  # type: ignore[return-value]
    if name.endswith(".zst"):
        return io.BufferedReader(ZstdFrames(raw), READ_BYTES)
    return raw


def compressed_error(path: Path, exc: Exception) -> InputError:
    """The run's error for a compressed input that cannot be read to its end."""
    reason = f"{CUT_SHORT} ({exc})" if isinstance(exc, EOFError) else str(exc)
    return InputError(f"cannot read compressed input: {reason}", where=str(path),
                      hint="copy or download the file again (`gzip -t` / `zstd -t` checks it)")


class ZstdFrames(io.RawIOBase):
    """A zstd file's decompressed bytes, frame after frame (`cat a.zst b.zst` is one input);
    EOFError where the file ends inside a frame."""

    def __init__(self, raw: IO[bytes]):
        import zstandard

        self._raw = raw
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._error = zstandard.ZstdError
        self._frame: Any = None  # the frame being read (None: between frames)
        self._pending = memoryview(b"")  # decompressed bytes not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            if not self._more():
                return 0
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def _more(self) -> bool:
        """The next input bytes decompressed into `_pending`; False at the end of the file."""
        leftover = b""
        if self._frame is not None and self._frame.eof:  # the bytes after a frame start the next one
            leftover, self._frame = self._frame.unused_data, None
        data = leftover or self._raw.read(READ_BYTES)
        if not data:
            if self._frame is not None:
                raise EOFError("the zstd stream ends inside a frame")
            return False
        if self._frame is None:
            self._frame = self._new()
        try:
            self._pending = memoryview(self._frame.decompress(data))
        except self._error as exc:
            raise OSError(f"not a valid zstd stream: {exc}") from None
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()
