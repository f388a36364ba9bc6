"""--backend ray across nodes: Ray's own multi-node test cluster (ray.cluster_utils.Cluster), a head and
worker nodes on this host, each a raylet with its own resources.

The head has no CPUs (`ray start --head --num-cpus 0`, as the scaling guide says), so no engine actor
lands on the driver's node. The fast tests run the job through the CLI and the real coordinator and
actors, with stand-in engines in the actors (the null engine's answers; one that keeps the rows it
takes): where the actors land, and a node removed while its actor holds rows. The real test submits
`qbatch run` through `ray job submit` (Ray's job server on the head) with the tiny model. One cluster
per file and part of the suite; no process of it is left afterwards, also after a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import psutil
import pytest

from qbatch.engines.base import NullEngine
from qbatch.engines.messages import EngineSample
from tests.jobs.test_signals import _alive

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 60  # a cluster's processes exit this long after it is shut down, at most
RAY_ENGINE = re.compile(r"actor (\d+) \(node ([0-9a-f]{8}), [^,]+, pid \d+\)")

pytest.importorskip("ray")


@contextlib.contextmanager
def ray_cluster(num_workers: int, **head: object) -> Iterator[object]:
    """A head without CPUs and `num_workers` nodes of 4 CPUs (room for every actor on one), shut down
    afterwards; none of its processes (raylets, GCS, workers, actors, theirs) may outlive it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(shutdown_at_exit=True)
    seen: dict[int, psutil.Process] = {}
    stopped = threading.Event()

    def note_processes() -> None:
        """Every process the nodes started and their descendants; noted every 0.5 s while the cluster
        runs, so that one whose parent died is still known (an engine's own processes)."""
        for node in cluster.list_all_nodes():
            for info in (i for infos in node.all_processes.values() for i in infos):
                with contextlib.suppress(psutil.Error):
                    top = psutil.Process(info.process.pid)
                    seen.update((p.pid, p) for p in [top, *top.children(recursive=True)])

    def keep_noting() -> None:
        while not stopped.wait(0.5):
            with contextlib.suppress(Exception):  # a node removed meanwhile
                note_processes()

    try:
        add_node(cluster, num_cpus=0, **head)
        for _ in range(num_workers):
            add_node(cluster, num_cpus=4)
        threading.Thread(target=keep_noting, name="ray-cluster-processes", daemon=True).start()
        yield cluster
    finally:
        stopped.set()
        note_processes()
        with contextlib.suppress(Exception):
            cluster.shutdown()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(p) for p in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for p in seen.values() if _alive(p)]
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()
        assert not left, f"processes of the Ray cluster left: {[(p.pid, p.name()) for p in left]}"


def add_node(cluster, **args):
    """cluster.add_node, without the SIGTERM handler each node sets in this process (to shut itself
    down): ray_cluster shuts the nodes down, and the tests this process runs next keep their own."""
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return cluster.add_node(**args)
    finally:
        signal.signal(signal.SIGTERM, sigterm)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(2, include_dashboard=False) as running:
        yield running


class StandInEngine:
    """The null engine's answers in an actor, at an idle engine's pace (the null engine itself spins on an
    empty feed). One that `stalls` takes two chunks, notes it in `held`, and never answers them."""

    max_num_seqs = 8

    def __init__(self, stalls: bool, held: Path):
        self.stalls, self.held = stalls, held

    def run(self, chunks):
        taken = 0
        for chunk in chunks:
            if chunk is None:
                time.sleep(0.005)
                yield None
            elif not self.stalls:
                yield from NullEngine().run([chunk])
            elif (taken := taken + 1) == 2:
                self.held.touch()
                while True:  # its rows stay in flight until its node goes
                    time.sleep(0.1)
                    yield None

    def sample(self) -> EngineSample:
        return EngineSample(0, 0, 0, 0, 0)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class StandIns:
    """How each actor starts its engine (RayEngine's `start`, pickled to the actors): a StandInEngine,
    the one on node `stalls_on` stalling; each notes its node in `folder`."""

    folder: str
    stalls_on: str | None = None

    def __call__(self, config, local_rank: int, local_world: int) -> StandInEngine:
        import ray

        node = ray.get_runtime_context().get_node_id()
        Path(self.folder, f"node-{os.getpid()}").write_text(node)
        return StandInEngine(node == self.stalls_on, Path(self.folder, "held"))


def ray_pool(start: StandIns):
    from ray import cloudpickle

    from qbatch.engines.pool import EnginePool
    from qbatch.engines.ray_actors import RayEngine

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import a test module
    return EnginePool(start=lambda config, wait=True: RayEngine(config, start=start))


@pytest.fixture
def rows():
    return [{"id": f"r{i:03d}", "prompt": f"prompt number {i} " * (1 + i % 5)} for i in range(300)]


def run_on(cluster, cli, job: list, pool, num_actors: int):
    """`qbatch run JOB --backend ray` on the cluster with `num_actors` actors; the pool is closed after."""
    try:
        return cli(*job, "--backend", "ray", "--ray-address", cluster.address, "--data-parallel-size",
                   str(num_actors), "--max-tokens", "8", "--chunk-tokens", "100", "--progress", "log", pool=pool)
    finally:
        pool.close_all()


def actor_nodes(records) -> dict[int, str]:
    """Each engine actor's node (short id), from the run's log."""
    return {int(m[1]): m[2] for r in records for m in RAY_ENGINE.finditer(r.getMessage())}


def test_engine_actors_spread_over_the_worker_nodes_none_on_the_drivers(cluster, cli, write_jsonl, rows,
                                                                        bundled_model, tmp_path, engine_log):
    from qbatch.engines.ray_actors import short_id

    job = ["run", write_jsonl(rows), "-o", tmp_path / "out", "--model", bundled_model]
    result = run_on(cluster, cli, job, ray_pool(StandIns(str(tmp_path))), 2)
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(tmp_path / "out" / "results.parquet")["id"].to_list() == [r["id"] for r in rows]
    workers = sorted(node.node_id for node in cluster.worker_nodes)
    assert sorted(path.read_text() for path in tmp_path.glob("node-*")) == workers  # one actor on each
    assert sorted(actor_nodes(engine_log.records).values()) == [short_id(node) for node in workers]
    assert "2 engine actors (CPU) on 2 Ray node(s): actor 0 (node " in engine_log.text


def test_a_node_lost_mid_run_loses_no_row_and_doubles_none(cluster, cli, write_jsonl, rows, bundled_model,
                                                           tmp_path, engine_log):
    """A third node joins; its actor takes two chunks and keeps them until the node is removed: its rows
    in flight go to the actors on the other nodes, and results.parquet holds every row once."""
    from qbatch.engines.ray_actors import short_id

    doomed = add_node(cluster, num_cpus=4)
    out, folder = tmp_path / "out", tmp_path / "engines"
    folder.mkdir()

    def remove_once_held() -> None:
        deadline = time.monotonic() + 120
        while not (folder / "held").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.remove_node(doomed)

    remover = threading.Thread(target=remove_once_held, daemon=True)
    remover.start()
    job = ["run", write_jsonl(rows), "-o", out, "--model", bundled_model]
    result = run_on(cluster, cli, job, ray_pool(StandIns(str(folder), stalls_on=doomed.node_id)), 3)
    remover.join()
    assert result.exit_code == 0, result.output
    assert (folder / "held").exists()
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == [r["id"] for r in rows]  # every row, each once
    assert json.loads((out / "manifest.json").read_text())["status"] == "completed"

    nodes = actor_nodes(engine_log.records)
    lost = next(rank for rank, node in nodes.items() if node == short_id(doomed.node_id))
    assert sorted(nodes.values()) == sorted(short_id(n.node_id) for n in [*cluster.worker_nodes, doomed])
    messages = [r.getMessage() for r in engine_log.records if r.levelname == "WARNING"]
    assert (f"Ray node {short_id(doomed.node_id)} left the cluster with engine actor(s) {lost}; their rows in "
            f"flight go to the other actors") in messages
    died = re.compile(rf"engine actor {lost} \(node {short_id(doomed.node_id)}, .+\) died; its ([0-9]+) rows in "
                      rf"flight \(2 chunks\) go to the others")
    assert [int(m[1]) for text in messages if (m := died.fullmatch(text))][0] > 0, messages


@pytest.mark.slow
def test_ray_job_submit_runs_qbatch_with_its_engine_on_a_worker_node(tiny_qwen3, tmp_path):
    """The real engine, once: `ray job submit -- qbatch run ...` on a cluster with Ray's job server; the
    driver runs on the head, the engine actor on the worker node, every row once."""
    from ray.job_submission import JobSubmissionClient

    from qbatch.engines.ray_actors import short_id

    rows = [{"id": f"r{i:02d}", "prompt": "word " * (1 + i % 20)} for i in range(40)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    qbatch = [sys.executable, "-m", "qbatch.cli", "run", str(inp), "-o", str(out), "--model", tiny_qwen3,
              "--max-model-len", "512", "--no-thinking", "--ignore-eos", "--max-tokens", "16", "--max-num-seqs", "8",
              "--backend", "ray", "--data-parallel-size", "1", "--progress", "log"]
    with ray_cluster(1, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=None) as cluster:
        address = f"http://{cluster.webui_url}"
        submit = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address, "--", *qbatch]
        started = time.monotonic()
        done = subprocess.run(submit, cwd=ROOT, capture_output=True, text=True, timeout=480)
        print(f"ray job submit: {time.monotonic() - started:.0f} s")
        assert done.returncode == 0, done.stdout + done.stderr
        job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", done.stdout)[1]
        driver = JobSubmissionClient(address).get_job_info(job_id).driver_node_id
        (worker,) = cluster.worker_nodes
        head = cluster.head_node.node_id
    assert driver == head
    assert f"1 engine actors (CPU) on 1 Ray node(s): actor 0 (node {short_id(worker.node_id)}, " in done.stdout
    results = pl.read_parquet(out / "results.parquet")
    assert results["id"].to_list() == [r["id"] for r in rows] and (results["completion_tokens"] == 16).all()
