"""Collects the documentation's examples (README.md, docs/) as tests: see tests/docs/harness.py."""

from tests.docs.harness import DOCS, README

pytest_collect_file = (DOCS + README).pytest()
