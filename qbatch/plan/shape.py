"""The second, pure step of resolving: the engines a job's shape calls for (jobs/shape.py samples the
shape from the first rows, tokenized, before any engine starts).

Engines per GPU and torch.compile are fixed when an engine starts; the choice is made only where it can
change something: on a GPU, with the vLLM backend, when the user set neither --engines-per-gpu,
--compilation-mode, --enforce-eager nor a compilation_config in QBATCH_VLLM_ARGS (an explicit setting
always wins).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qbatch.plan.placement import (TORCH_COMPILE, EngineChoice, choose_engines, choose_kept_engines,
                                   too_short_to_compile)
from qbatch.plan.resolve import Plan, compile_cache_warm, resolve


@dataclass(frozen=True)
class JobShape:
    """Rows to process and their tokens (output: max_tokens x n, the most they may generate)."""

    rows: int
    prompt_tokens: int
    output_tokens: int
    estimated: bool  # from a sample and the inputs' sizes (else every row was sampled)


def may_choose(plan: Plan) -> bool:
    """Whether the job's shape may choose its engines (see the module's note)."""
    engine = plan.requested.engine
    if engine.backend != "vllm" or engine.engines_per_gpu is not None or engine.compilation_mode is not None \
            or engine.enforce_eager is not None or "compilation_config" in plan.machine.extra_args:
        return False
    return plan.machine.gpu_memory_bytes is not None


def default_engines(plan: Plan) -> int:
    return plan.spec.engine.engines_per_gpu or 1


def candidates(plan: Plan) -> list[Plan]:
    """The plans a choice may give, the plan itself first: a running engine of one of them (a Session's)
    beats starting any (jobs/shape.py asks the pool)."""
    reused = "an engine of these settings is running: reused"
    compiled = [with_choice(plan, EngineChoice(n, TORCH_COMPILE, reused)) for n in dict.fromkeys((default_engines(plan), 1))]
    return [plan, *(dataclasses.replace(p, choice=None) for p in compiled)]


def with_choice(plan: Plan, choice: EngineChoice) -> Plan:
    """The plan with `choice`'s engines (and, unless the user set it, the chunk size that follows)."""
    engine = plan.spec.engine
    if (engine.engines_per_gpu, engine.compilation_mode) == (choice.engines_per_gpu, choice.compilation_mode):
        return plan
    return resolve(plan.requested, plan.machine, choice=choice)


def resolve_for_size(plan: Plan, max_prompt_tokens: int) -> Plan | None:
    """The plan with its default engines when the inputs' size alone shows the job too short to repay
    torch.compile (at most `max_prompt_tokens`, jobs/shape.py counts them without the tokenizer): its
    engines then start without waiting for the tokenizer and a sample. None when the size cannot tell."""
    if not may_choose(plan) or not too_short_to_compile(max_prompt_tokens):
        return None
    choice = EngineChoice(default_engines(plan), None, f"at most {max_prompt_tokens:,} prompt tokens (the inputs' "
                                                       "size): too short to repay torch.compile, the defaults")
    return dataclasses.replace(with_choice(plan, choice), choice=choice)


def resolve_for_kept(plan: Plan) -> Plan | None:
    """The plan with the engines a Session or a service keeps for later runs (placement.choose_kept_engines:
    compiled where this machine compiled them before); None where no such choice is made."""
    if not may_choose(plan):
        return None
    choice = choose_kept_engines(compile_cache_warm=_compiled_before(plan), default_engines=default_engines(plan))
    return None if choice is None else dataclasses.replace(with_choice(plan, choice), choice=choice)


def resolve_for_shape(plan: Plan, shape: JobShape) -> Plan:
    """The plan with the engines the job's shape calls for (plan.choice says which and why); the plan
    as it is where no choice is made (see may_choose) or the job has no rows."""
    if not may_choose(plan) or not shape.rows:
        return plan
    choice = choose_engines(shape.prompt_tokens, shape.output_tokens, shape.rows, gpu=True,
                            compile_cache_warm=_compiled_before(plan), default_engines=default_engines(plan))
    return dataclasses.replace(with_choice(plan, choice), choice=choice)


def _compiled_before(plan: Plan) -> bool:
    """Whether this machine compiled the plan's default engines with torch.compile before."""
    compiled = candidates(plan)[1]
    return compile_cache_warm(compiled.spec.engine, compiled.max_model_len, plan.machine)
