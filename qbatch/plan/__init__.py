"""A job resolved once, before any engine starts: `probe(spec, model_path)` reads the world (probing.py, into a Machine:
machine.py; the model made ready before it, models/ready.py), `resolve(spec,
machine)` decides (resolve.py), `resolve_for_shape` decides again from the job's shape (shape.py), and the
Plan says what each engine's LLM(...) gets and why (show.py)."""

from qbatch.plan.machine import Machine, ModelFacts
from qbatch.plan.probing import probe
from qbatch.plan.resolve import Decision, Plan, resolve
from qbatch.plan.shape import JobShape, resolve_for_shape

__all__ = ["Decision", "JobShape", "Machine", "ModelFacts", "Plan", "probe", "resolve", "resolve_for_shape"]
