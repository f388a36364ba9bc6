"""A JSON array of rows (what pandas' `to_json(orient="records")` writes, on one line or pretty-printed),
split into its elements as it is read: the file is never parsed whole, so a large one costs one element
of memory at a time, as a JSONL file costs one line.

The splitter only finds where each element starts and ends (strings, brackets, commas); each element's
bytes are then parsed as a JSONL line is (readers.py), so an element that is not an object, or not valid
JSON, is that row's error, located at the line where it starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import IO

READ_BYTES = 1 << 20
WHITESPACE = b" \t\r\n"
BOM = b"\xef\xbb\xbf"
# outside strings, what the splitter looks for: a whole string (skipped in one match), the start of one
# that the buffer does not hold to its end, and the bytes that open, close or separate elements
TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|"|[][{},]')
QUOTE, COMMA, OPENERS, CLOSERS = ord('"'), ord(","), b"[{", b"]}"


class ArrayError(ValueError):
    """The file is not a whole JSON array: `line` is where reading stopped."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


def starts_array(handle: IO[bytes]) -> bool:
    """Whether the first byte that is not blank (after a byte-order mark) is `[`; reads a little of `handle`."""
    head = handle.read(4096).removeprefix(BOM).lstrip(WHITESPACE)
    while not head:
        block = handle.read(READ_BYTES)
        if not block:
            return False
        head = block.lstrip(WHITESPACE)
    return head.startswith(b"[")


def array_elements(handle: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line where it starts, bytes) of each element of the array `handle` holds, blank around it stripped.
    An empty element (`[1,,2]`, `[1,]`) is yielded as b"" (a row that fails); ArrayError for bytes before
    the `[` or after the `]`, or a file that ends inside the array."""
    buf = bytearray()
    while block := handle.read(READ_BYTES):  # up to the first byte that is not blank
        buf += block
        if len(buf) >= len(BOM) and buf.removeprefix(BOM).lstrip(WHITESPACE):
            break
    buf = buf.removeprefix(BOM)
    begin = len(buf) - len(buf.lstrip(WHITESPACE))
    line = 1 + buf.count(b"\n", 0, begin)
    if not buf[begin:begin + 1] == b"[":
        raise ArrayError("the file does not start with a JSON array's '['", line)
    pos = begin = begin + 1  # begin: where the element being read starts; `line`: the line there
    depth, count, more = 1, 0, READ_BYTES  # depth 1: between elements; more: bytes to read next
    while True:
        for match in TOKEN.finditer(buf, pos):
            char = buf[match.start()]
            if char == QUOTE:
                if match.end() - match.start() == 1:  # a string the buffer ends inside: read on, then again
                    pos = match.start()
                    break
            elif char in OPENERS:
                depth += 1
            elif char in CLOSERS:
                depth -= 1
            if (char in CLOSERS and depth == 0) or (char == COMMA and depth == 1):  # an element ends
                element, first = _stripped(buf, begin, match.start())
                if element or char == COMMA or count:  # `[]` holds no element; `[1,]` an empty one
                    yield line + buf.count(b"\n", begin, first), element
                    count += 1
                line += buf.count(b"\n", begin, match.end())
                begin = match.end()
                if depth == 0:
                    return _check_end(handle, buf[begin:], line)
            pos = match.end()
        else:
            pos = len(buf)
        del buf[:begin]  # only the element being read stays in memory
        pos, begin = pos - begin, 0
        block = handle.read(more)
        if not block:
            line += buf.count(b"\n", 0, _first_byte(buf, 0, len(buf)))
            raise ArrayError("the JSON array ends before its closing ']': the file is cut short "
                             f"(it ends inside element {count + 1}, which starts at line {line})", line)
        buf += block
        more = max(READ_BYTES, len(buf))  # a long element: read as much again, not rescan a string per block


def _stripped(buf: bytearray, start: int, end: int) -> tuple[bytes, int]:
    """buf[start:end] without blank around it but the indent of its first line (a JSON error's column is
    then the file's, in a pretty-printed array), and where its first byte that is not blank is in `buf`."""
    first = _first_byte(buf, start, end)
    while end > first and buf[end - 1] in WHITESPACE:
        end -= 1
    indent = first
    while indent > start and buf[indent - 1] in b" \t":
        indent -= 1
    return (bytes(buf[indent:end]) if end > first else b""), first


def _first_byte(buf: bytearray, start: int, end: int) -> int:
    while start < end and buf[start] in WHITESPACE:
        start += 1
    return start


def _check_end(handle: IO[bytes], rest: bytearray, line: int) -> None:
    """Only blank may follow the array's `]`."""
    while True:
        text = bytes(rest).lstrip(WHITESPACE)
        if text:
            raise ArrayError("the file goes on after the JSON array's closing ']'",
                             line + bytes(rest[:len(rest) - len(text)]).count(b"\n"))
        rest = bytearray(handle.read(READ_BYTES))
        if not rest:
            return
