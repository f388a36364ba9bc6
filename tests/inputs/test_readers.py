"""JSONL line parsing: orjson (when installed) gives exactly what json gives, or stands aside."""

from __future__ import annotations

import pytest

from qbatch.inputs import readers

LINES = [
    b'{"id": "a", "prompt": "hello", "n": 3, "t": 0.7, "stop": ["x"], "m": {"k": [1, 2.5, null, true]}}\n',
    b'{"id": 123456789012345678901234567890, "prompt": "big int"}',  # orjson would make it a float
    b'{"id": 1, "nested": [{"v": -98765432109876543210}]}',
    b'{"id": 1, "x": 1e300, "y": -0.0, "z": 9007199254740993}',
    b'{"id": 1, "x": NaN, "y": Infinity, "z": 1e400}',  # json accepts these, orjson does not
    b'{"id": 1, "s": "\\ud800 lone surrogate"}',
    b'{"id": 1, "id": 2}',
    '{"id": "ünï", "prompt": "中文 🙂"}'.encode(),
    b'{"a": "\xff"}',
    b"{oops",
    b"[1, 2]",
    b'"text"',
    b'{"a": 1} trailing',
]


@pytest.mark.parametrize("line", LINES)
def test_orjson_and_json_parse_lines_alike(line, monkeypatch):
    pytest.importorskip("orjson")
    fast = readers._parse_line(line)
    monkeypatch.setattr(readers, "fast_loads", None)
    slow = readers._parse_line(line)
    assert repr(fast) == repr(slow)  # repr: NaN != NaN, and 1 == 1.0 would hide a type change
    assert [type(v) for v in (fast[0] or {}).values()] == [type(v) for v in (slow[0] or {}).values()]
