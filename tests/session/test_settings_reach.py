"""Every setting declared in spec.py reaches the job through each door that takes it, with nothing restated:
a Session's engine settings (Session(...)), a call's job settings (session.plan/run(...)), and the service's
`--server` jobs (RunRequest over the wire, then spec_for). A setting added to spec.py is in these tests
at once: one that a door drops, or refuses, fails them."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from qbatch import __version__
from qbatch.jobs import runner
from qbatch.serve.config import ServeSettings
from qbatch.serve.runs import spec_for
from qbatch.serve.wire import RunRequest
from qbatch.session import Session
from qbatch.spec import ENGINE_SETTINGS, JOB_OWN_ENGINE_SETTINGS, SECTIONS, JobSpec, choices, declared

# Values another setting's rule ties (validate()), or that must parse: the rest are made from the declaration
SAMPLES = {"shard": "1/2", "gpus": ["0"], "data_parallel_size": 1, "top_p": 0.5, "json_schema": '{"type": "object"}',
           "regex": "a+", "grammar": 'root ::= "a"', "choice": ["a", "b"], "lora": {"tone": "/adapters/tone"},
           "backend": "null", "top_logprobs": 2, "model": None,  # the session's first argument: its own tests
           **dict.fromkeys(("ray_address", "max_loras", "max_lora_rank", "max_cpu_loras"))}
# What a door sets itself: the data and where the results go are a call's arguments, the task its method's
DOORS_OWN = {"inputs", "output_dir", "task"}
HINTS = {key: hint for cls in SECTIONS.values() for key, hint in typing.get_type_hints(cls).items()}
FIELDS = [(name, f, HINTS[f.name]) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
          if f.name not in DOORS_OWN]


def _sample(f: dataclasses.Field, hint: typing.Any) -> typing.Any:
    """A value of the setting other than its default, in its range."""
    if f.name in SAMPLES:
        return SAMPLES[f.name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    options = choices(hint)
    if options:
        return next(option for option in options if option != default)
    kinds = typing.get_args(hint) or (hint,)
    setting = declared(f)
    if bool in kinds:
        return not default
    if int in kinds:
        return min(int(setting.low or 0) + 2, int(setting.high or 100))
    if float in kinds:
        return 0.5
    if str in kinds:
        return "x"
    return ["a", "b"]  # a list of strings


def _check_reaches(spec: JobSpec, section: str, name: str, value: typing.Any) -> None:
    got = getattr(getattr(spec, section), name)
    assert got == value or (isinstance(value, list) and list(got) == value), (name, got, value)


@pytest.fixture
def planned(monkeypatch):
    """session.plan(...) answers with the spec it would plan (nothing resolved, no engine)."""
    monkeypatch.setattr(runner, "plan", lambda spec, pool: spec)


@pytest.mark.parametrize(("section", "f", "hint"), FIELDS, ids=[f.name for _, f, _ in FIELDS])
def test_each_setting_reaches_a_sessions_job(planned, bundled_model, section, f, hint):
    value = _sample(f, hint)
    if value is None:
        pytest.skip("tied to other settings: their own tests")
    if f.name in ENGINE_SETTINGS:
        spec = Session(bundled_model, **{f.name: value}).plan(["hi"])
    else:
        spec = Session(bundled_model).plan(["hi"], **{f.name: value})
    _check_reaches(spec, section, f.name, value)


@pytest.mark.parametrize(("section", "f", "hint"), FIELDS, ids=[f.name for _, f, _ in FIELDS])
def test_each_setting_reaches_a_service_job(bundled_model, tmp_path, section, f, hint):
    """A job setting the client sends is the job's; an engine setting is the service's (the job may name
    it only as the service runs it), but for the job's own (its seed, its adapters)."""
    value = _sample(f, hint)
    if value is None:
        pytest.skip("tied to other settings: their own tests")
    served_by = f.name in ENGINE_SETTINGS - JOB_OWN_ENGINE_SETTINGS
    settings = ServeSettings(tmp_path, {"model": bundled_model, **({f.name: value} if served_by else {})})
    values = {"inputs": [str(tmp_path / "in.jsonl")], "output_dir": str(tmp_path / "out"), f.name: value}
    sent = RunRequest.from_json(json.loads(RunRequest(values, __version__).to_json()))
    _check_reaches(spec_for(sent.values, settings), section, f.name, value)


def test_a_settings_environment_variable_reaches_a_session(planned, bundled_model, monkeypatch):
    """As the CLI's `--model` reads QBATCH_MODEL (the setting's declared envvar), so does a Session; a
    model given wins."""
    monkeypatch.setenv("QBATCH_MODEL", bundled_model)
    assert Session().plan(["hi"]).engine.model == bundled_model
    assert Session("another-model").engine_settings["model"] == "another-model"
