"""The tokenizer loads once when many threads ask for it at once (the service's first online requests)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, threading
from qbatch.tokens import _load_tokenizer, load_tokenizer
errors, got = [], []
def load():
    try:
        got.append(load_tokenizer(sys.argv[1]))
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=load) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors[:2]
assert len({id(t) for t in got}) == 1 and len(got) == 16, len(got)
assert _load_tokenizer.cache_info().misses == 1
"""


def test_sixteen_threads_load_one_tokenizer_in_a_fresh_process(bundled_model):
    # a fresh interpreter each time: Transformers not yet imported, as in a service's first requests
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", SCRIPT, bundled_model], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
