"""What names an object or a folder of objects: `s3://bucket/key`, `gs://bucket/key`, `hf://datasets/org/name/file`."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

SCHEMES = ("s3", "gs", "hf")
GLOB_CHARS = "*?["


def is_remote(text: object) -> bool:
    """Whether `text` is the URL of an object store's object, folder or glob (a scheme of SCHEMES)."""
    return isinstance(text, str) and text.partition("://")[0] in SCHEMES and "://" in text


@dataclass(frozen=True)
class Url:
    """An object store URL, split: `scheme://path` (path: bucket and key, no slash at either end)."""

    scheme: str
    path: str

    @classmethod
    def parse(cls, text: str) -> Url:
        scheme, _, path = text.partition("://")
        return cls(scheme, path.strip("/"))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"

    @property
    def bucket(self) -> str:
        return self.path.partition("/")[0]

    @property
    def key(self) -> str:
        return self.path.partition("/")[2]

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def is_glob(self) -> bool:
        return any(ch in self.path for ch in GLOB_CHARS)

    def child(self, *names: str) -> Url:
        return Url(self.scheme, posixpath.join(self.path, *names))

    def relative(self, other: Url) -> str:
        """`other`'s path below this one (`parts/part-000001.parquet`)."""
        return posixpath.relpath(other.path, self.path)
