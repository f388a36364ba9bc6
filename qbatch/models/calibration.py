"""AWQ calibration prompts, read and rendered exactly as `qbatch run` renders them.

AutoAWQ takes the first N texts that fit in `seq_len` tokens, concatenates them
and cuts blocks of `seq_len`. Choosing them here by the same rule lets qbatch
count the tokens before any weight loads and hand AutoAWQ token ids, so it
neither re-tokenizes nor downloads its default data set.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qbatch.errors import InputError
from qbatch.records import Request, Row
from qbatch.spec import InputSpec, JobSpec
from qbatch.tokens import encode_prompts

if TYPE_CHECKING:
    from qbatch.inputs.prepare import Preparer

CALIB_FILE = Path(__file__).resolve().parents[2] / "sample_data" / "calib.jsonl"
WINDOW_ROWS = 256


@dataclass
class Calibration:
    files: list[str]
    sha256: str
    token_ids: list[list[int]]
    seq_len: int
    num_skipped_long: int = 0
    num_rows_failed: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.token_ids))

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.seq_len

    def describe(self) -> str:
        return (f"{len(self.token_ids)} texts, {self.num_tokens:,} tokens -> {self.num_blocks} blocks of {self.seq_len}"
                f" ({', '.join(Path(f).name for f in self.files)})")


def calibration_files(calib: str | None) -> list[Path]:
    """The files of --calib (files, folders, globs), or the shipped sample_data/calib.jsonl."""
    from qbatch.inputs.readers import expand_inputs

    if calib is not None:
        return expand_inputs([calib])
    if not CALIB_FILE.is_file():
        raise InputError("the shipped calibration file is missing", where=str(CALIB_FILE),
                         hint="pass --calib FILE (JSONL/Parquet prompts), or install qbatch from a checkout")
    return [CALIB_FILE]


def load_calibration(files: list[Path], tokenizer: Any, *, samples: int, seq_len: int) -> Calibration:
    """The first `samples` prompts of at most `seq_len` tokens; refuses data that fills no block."""
    calibration = Calibration([str(f) for f in files], files_sha256(files), [], seq_len)
    for request in _requests(files, tokenizer, calibration):
        if request.num_prompt_tokens > seq_len:
            calibration.num_skipped_long += 1  # AutoAWQ would drop it too
            continue
        calibration.token_ids.append(request.prompt_token_ids)
        if len(calibration.token_ids) == samples:
            break
    if calibration.num_blocks < 1:
        num_texts, num_long = len(calibration.token_ids), calibration.num_skipped_long
        skipped = f"; {num_long} more were skipped as longer than {seq_len} tokens" if num_long else ""
        more = "raise --calib-samples" if num_texts == samples else "pass a larger --calib FILE"
        hint = (f"raise --calib-seq-len (now {seq_len}) to keep the long texts, or {more}" if num_long else
                f"lower --calib-seq-len (now {seq_len}) or {more}")
        raise InputError(f"calibration data has {calibration.num_tokens:,} tokens in {num_texts} texts, but AWQ needs "
                         f"at least {seq_len:,} (one block of --calib-seq-len){skipped}",
                         where=", ".join(calibration.files), hint=hint)
    return calibration


def files_sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _requests(files: list[Path], tokenizer: Any, calibration: Calibration) -> Iterator[Request]:
    """Rows -> tokenized prompts, window by window, in file order (bad rows are counted and left out)."""
    from qbatch.inputs.prepare import Preparer
    from qbatch.inputs.readers import read_rows

    # Default `run` settings; a model without a chat template gets its prompts as is.
    spec = JobSpec(input=InputSpec(inputs=[str(f) for f in files], raw=not getattr(tokenizer, "chat_template", None)))
    preparer = Preparer(spec, tokenizer, max_model_len=sys.maxsize, base_sampling={"max_tokens": 1},
                        positional_prefix=len(files) > 1)
    window: list[tuple[Row, str]] = []
    for row in read_rows(files):
        window.append((row, preparer.row_id(row)))
        if len(window) == WINDOW_ROWS:
            yield from _prepare(preparer, window, calibration)
            window = []
    if window:
        yield from _prepare(preparer, window, calibration)


def _prepare(preparer: Preparer, window: list[tuple[Row, str]], calibration: Calibration) -> list[Request]:
    requests, failures = preparer.prepare(window)
    calibration.num_rows_failed += len(failures)
    encode_prompts(requests, preparer.encoder)  # AWQ takes token ids: the engines' step, done here
    return requests
