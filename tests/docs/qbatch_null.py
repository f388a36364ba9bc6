"""`qbatch ARGS` on the null engine: the docs examples' `qbatch` inside shell pipelines (harness.py)."""

import sys

from harness import with_null_backend  # this file's folder is on sys.path: it is the script run

from qbatch.cli import main

sys.argv = ["qbatch", *with_null_backend(sys.argv[1:])]
main()
