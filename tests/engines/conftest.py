"""Fixtures of the engine tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def engine_log(caplog):
    """The qbatch logger's records, at INFO and up, whether or not qbatch.log.setup() stopped propagation."""
    from qbatch.log import log

    log.addHandler(caplog.handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)
        log.setLevel(level)
