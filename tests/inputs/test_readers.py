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


def test_lines_of_a_file_drop_a_leading_byte_order_mark_and_skip_blank_lines():
    lines = [b"\xef\xbb\xbf" + b'{"id": 1}\n', b"\n", b'{"id": "\xef\xbb\xbf"}\n']  # a BOM inside a line stays
    assert list(readers.read_lines(lines)) == [(1, b'{"id": 1}\n'), (3, b'{"id": "\xef\xbb\xbf"}\n')]
    assert readers.parse_line(b'{"id": 1}').data == {"id": 1}


def test_a_bad_line_message_names_its_column_once():
    parsed = readers.parse_line(b'{"id": "a", "prompt": "unterminated')
    assert parsed.data is None
    assert parsed.error == "line is not valid JSON: Unterminated string starting at column 23"


def test_reading_stops_at_the_bytes_the_run_hashed(tmp_path):
    """Rows appended while a run reads the file are left for the next run, as its fingerprint says."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n')
    rows = list(readers.read_rows([path], sizes=[24]))
    assert [row.data for row in rows] == [{"id": "a"}, {"id": "b"}]


@pytest.mark.parametrize(("content", "size"), [
    (b'{"id": "a"}\n{"id": "b"}\n', 24),
    (b'{"id": "a"}\n{"id": "b"}', 23),  # a complete last line without its newline is a row
    (b'{"id": "a"}\n{"id": "b", "pro', 12),  # a half-written one is left for the next run
    (b'{"id": "a"}\n  \n', 15),
    (b'{"id": "b", "pro', 0),
    (b"", 0),
])
def test_the_bytes_of_a_jsonl_file_that_hold_rows_now(tmp_path, content, size):
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    assert readers.rows_size(path) == size


@pytest.mark.parametrize("read_bytes", [1, 7, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_is_split_into_its_elements_whatever_the_reads(read_bytes, indent, monkeypatch):
    """Strings holding brackets, commas and escaped quotes, elements across reads: each element whole,
    with the line where it starts."""
    import io
    import json

    from qbatch.inputs import json_array

    monkeypatch.setattr(json_array, "READ_BYTES", read_bytes)
    rows = [{"id": i, "prompt": 'a "quoted\\" ], } [ {' * i, "n": [1, {"x": "]"}]} for i in range(20)]
    data = json.dumps(rows, indent=indent).encode()
    elements = list(json_array.array_elements(io.BytesIO(data)))
    assert [json.loads(raw) for _, raw in elements] == rows
    lines = data.split(b"\n")
    assert all(lines[line - 1].strip().startswith(b"{" if indent else b"[{") for line, _ in elements)
    assert list(json_array.array_elements(io.BytesIO(b" [ ] "))) == []
    assert list(json_array.array_elements(io.BytesIO(b"[1,,2,]"))) == [(1, b"1"), (1, b""), (1, b"2"), (1, b"")]
