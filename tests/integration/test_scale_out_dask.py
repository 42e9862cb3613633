"""rootstock.evaluate on real Dask LocalClusters (count-emt and EMT envs built by uv).

Every cluster binds to 127.0.0.1 only. The ``count-emt`` env writes one line per
``setup()`` to a count file (its pid, its parent's pid, ``CUDA_VISIBLE_DEVICES``), so
the tests count model loads per Dask worker, see which Dask worker started each
Rootstock worker, and read the GPU the plugin pinned it to. Each cluster is closed
in teardown; the kill test also checks that no Rootstock worker outlives it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import distributed  # the [dask] extra, which the test extra installs: never skipped
import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

import rootstock
from rootstock.errors import EngineError, WorkerError
from rootstock.parallel import dask_local_client
from rootstock.parallel.dask_engine import PLUGIN_NAME, _plugin_names
from tests.integration.killing import is_running, live_descendants

pytestmark = pytest.mark.usefixtures("runtime_isolation")
# On a loaded machine (CI runners share their cores with other jobs) starting a Dask
# worker or a Rootstock worker may take minutes instead of seconds. So every wait
# polls its condition under a generous deadline and assumes no start-up time; each
# test's timeout is the sum of its waits, so a stuck wait fails first, saying what
# it waited for.
BUILD_S = 900  # whichever test runs first waits for the session's root build (real uv)
ARRIVE_S = 300  # Dask workers to register with the scheduler
START_S = 300  # evaluate's start_timeout: a first engine worker to arrive
RUN_S = 120  # one evaluate on workers that are up (seconds, unloaded)
WATCH_S = 300  # a killer thread, for its moment to kill
RELEASE_S = 300  # the scheduler, to forget a finished run's chunks
CLOSE_S = 120  # a client, then its cluster, to close
GONE_S = 300  # Rootstock workers, to exit once their cluster is closed


def cu_cells(n: int, seed: int = 0) -> list[Any]:
    """``n`` rattled Cu cells of two sizes (4 and 8 atoms), alternating."""
    cells = []
    for i in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        if i % 2:
            atoms = atoms * (1, 1, 2)
        atoms.rattle(0.05, seed=seed + i)
        cells.append(atoms)
    return cells


def assert_matches_emt(images: list[Any], results: list[Any]) -> None:
    """Each result equals in-process ASE EMT on the same structure, to 1e-10."""
    assert len(results) == len(images)
    for atoms, result in zip(images, results, strict=True):
        ref = atoms.copy()
        ref.calc = EMT()
        assert result["energy"] == pytest.approx(ref.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(result["forces"], ref.get_forces(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(result["stress"], ref.get_stress(), rtol=0, atol=1e-10)


def setups(count_file: Path) -> list[dict[str, Any]]:
    """The count-emt ``setup()`` records, one per model load."""
    if not count_file.exists():
        return []
    return [json.loads(line) for line in count_file.read_text().splitlines() if line]


def started_calculations(trace_file: Path, pid: int) -> int:
    """How many calculations the Rootstock worker ``pid`` has started (whole lines)."""
    lines = trace_file.read_text().splitlines() if trace_file.exists() else []
    return sum(1 for line in lines if line.endswith("}") and json.loads(line)["pid"] == pid)


def kill_if_mid_chunk(load: dict[str, Any], trace_file: Path, batch_size: int) -> bool:
    """SIGKILL the Dask worker that started ``load``'s Rootstock worker if it is running
    a chunk; True if it did.

    Decided by count while the Rootstock worker is stopped (SIGSTOP), so no timing is
    assumed, however loaded the machine: with k calculations started (one per
    structure) and k not a multiple of ``batch_size``, the chunk still has structures
    to compute, each sleeping ``delay``, so its Dask task cannot have finished.
    """
    os.kill(load["pid"], signal.SIGSTOP)
    try:
        if not started_calculations(trace_file, load["pid"]) % batch_size:
            return False
        os.kill(load["ppid"], signal.SIGKILL)
        return True
    finally:
        os.kill(load["pid"], signal.SIGCONT)


def kill_one_mid_chunk(
    count_file: Path, trace_file: Path, batch_size: int, loads: int, done: threading.Event
) -> int | None:
    """Once ``loads`` models have loaded, SIGKILL the first Dask worker caught running a
    chunk (:func:`kill_if_mid_chunk`) and return its pid; None if ``done`` is set (the
    run ended) or WATCH_S passes first."""
    deadline = time.monotonic() + WATCH_S
    while not done.is_set() and time.monotonic() < deadline:
        running = setups(count_file)
        if len(running) >= loads:
            for load in running:
                # Only a worker that looks mid-chunk is stopped for the exact check.
                if started_calculations(trace_file, load["pid"]) % batch_size and (
                    kill_if_mid_chunk(load, trace_file, batch_size)
                ):
                    return load["ppid"]
        time.sleep(0.01)
    return None


def worker_pids(client: Any) -> set[int]:
    """The pids of the client's Dask worker processes (not their nannies)."""
    return set(client.run(os.getpid).values())


def close_client(client: Any) -> None:
    """Close a client and the LocalCluster it runs on."""
    cluster = client.cluster
    with contextlib.suppress(Exception):
        client.close(timeout=CLOSE_S)
    if cluster is not None:
        with contextlib.suppress(Exception):
            cluster.close(timeout=CLOSE_S)


def wait_gone(pids: set[int], timeout: float = GONE_S) -> set[int]:
    """The pids among ``pids`` still running after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    alive = {p for p in pids if is_running(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {p for p in alive if is_running(p)}
    return alive


@pytest.fixture(scope="module", autouse=True)
def quiet_distributed():
    """Dask's worker-restart warnings are expected here; keep them out of the log."""
    logger = logging.getLogger("distributed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="module")
def pinned_client():
    """One LocalCluster of 2 single-thread workers, pinned to "GPUs" 0 and 1."""
    client = dask_local_client(workers=2, gpus=2)
    try:
        client.wait_for_workers(2, timeout=ARRIVE_S)
        yield client
    finally:
        close_client(client)


@pytest.mark.timeout(BUILD_S + ARRIVE_S + 3 * RUN_S + 2 * CLOSE_S)
def test_local_cluster_matches_emt_and_loads_once_per_worker(
    pinned_client, fake_built_root: Path, tmp_path: Path
):
    """Results equal in-process EMT in input order; setup() runs once per Dask worker
    (2), pinned by the plugin to CUDA_VISIBLE_DEVICES 0 and 1; a second evaluate and
    evaluate_iter reuse the warm workers and the installed plugin."""
    client = pinned_client
    count = tmp_path / "count.jsonl"
    images = cu_cells(40)
    kwargs = {
        "root": fake_built_root,
        "start_timeout": START_S,
        "setup_kwargs": {"count_file": str(count)},
    }
    plugin_ids = client.run(lambda dask_worker: id(dask_worker.plugins[PLUGIN_NAME]))

    with distributed.get_task_stream(client) as stream:
        results = rootstock.evaluate(
            images, checkpoint="count-emt", executor=client, batch_size=4, **kwargs
        )
    assert_matches_emt(images, results)
    per_worker: dict[str, int] = {}
    for record in stream.data:
        per_worker[record["worker"]] = per_worker.get(record["worker"], 0) + 1
    assert sum(per_worker.values()) == 10  # 40 structures in chunks of 4
    # Both workers ran chunks. How many each is timing: a worker slower to start its
    # Rootstock worker (a loaded machine) may have its queued chunk stolen by the other.
    assert len(per_worker) == 2, per_worker

    loads = setups(count)
    assert len(loads) == 2, loads
    assert {load["ppid"] for load in loads} == worker_pids(client)
    assert sorted(load["cuda_visible_devices"] for load in loads) == ["0", "1"]
    rootstock_pids = {load["pid"] for load in loads}

    second = cu_cells(40, seed=100)
    streamed = list(
        rootstock.evaluate_iter(
            second, checkpoint="count-emt", executor=client, batch_size=4, **kwargs
        )
    )
    assert sorted(index for index, _ in streamed) == list(range(40))
    assert_matches_emt(second, [result for _, result in sorted(streamed, key=lambda x: x[0])])
    again = rootstock.evaluate(
        images, checkpoint="count-emt", executor=client, batch_size=8, **kwargs
    )
    assert_matches_emt(images, again)

    # Warm workers survived: no new load, the same Rootstock workers, the same plugin.
    assert setups(count) == loads
    assert client.run(lambda dask_worker: id(dask_worker.plugins[PLUGIN_NAME])) == plugin_ids
    children = {pid for ppid in worker_pids(client) for pid in live_descendants(ppid)}
    assert rootstock_pids <= children


@pytest.mark.timeout(BUILD_S + ARRIVE_S + 2 * RUN_S + RELEASE_S + 2 * CLOSE_S)
def test_errors_rule_and_empty_input(pinned_client, fake_built_root: Path, tmp_path: Path):
    """A structure EMT cannot compute: errors="raise" names it, errors="return" puts
    its WorkerError in its slot only. An empty input submits nothing."""
    client = pinned_client
    count = tmp_path / "count.jsonl"
    kwargs = {
        "root": fake_built_root,
        "start_timeout": START_S,
        "executor": client,
        "batch_size": 3,
        "setup_kwargs": {"count_file": str(count)},
    }
    images = cu_cells(10)
    images[7].numbers[0] = 92  # EMT has no potential for U

    with pytest.raises(WorkerError, match=r"structure 7: .*No EMT-potential for U"):
        rootstock.evaluate(images, checkpoint="count-emt", **kwargs)
    results = rootstock.evaluate(images, checkpoint="count-emt", errors="return", **kwargs)
    assert isinstance(results[7], WorkerError)
    assert "structure 7" in str(results[7])
    good = [i for i in range(10) if i != 7]
    assert not any(isinstance(results[i], WorkerError) for i in good)
    assert_matches_emt([images[i] for i in good], [results[i] for i in good])

    empty = tmp_path / "empty.jsonl"

    def scheduler_tasks(dask_scheduler: Any) -> tuple[int, int]:
        return len(dask_scheduler.tasks), dask_scheduler.transition_counter

    # The chunks above are released asynchronously, and probably (not proven) the
    # raised WorkerError's traceback keeps the dispatch frame, with its last futures,
    # alive until a cyclic garbage collection: collect while waiting. The product
    # should drop those futures before raising (filed as follow-up work).
    deadline = time.monotonic() + RELEASE_S
    while client.run_on_scheduler(scheduler_tasks)[0] and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    before = client.run_on_scheduler(scheduler_tasks)
    assert before[0] == 0
    kwargs["setup_kwargs"] = {"count_file": str(empty)}
    assert rootstock.evaluate([], checkpoint="count-emt", **kwargs) == []
    assert list(rootstock.evaluate_iter(iter(()), checkpoint="count-emt", **kwargs)) == []
    time.sleep(0.3)
    assert client.run_on_scheduler(scheduler_tasks) == before
    assert not empty.exists()


@pytest.mark.timeout(BUILD_S + START_S + RUN_S + 2 * CLOSE_S)
def test_user_client_gets_the_plugin(fake_built_root: Path, tmp_path: Path):
    """A Client the user made, without our plugin: evaluate installs it and works,
    and leaves CUDA_VISIBLE_DEVICES as the worker had it."""
    cluster = distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
    )
    client = distributed.Client(cluster)
    try:
        assert PLUGIN_NAME not in client.run_on_scheduler(_plugin_names)
        count = tmp_path / "count.jsonl"
        images = cu_cells(12)
        results = rootstock.evaluate(
            images,
            checkpoint="count-emt",
            root=fake_built_root,
            executor=client,
            batch_size=4,
            start_timeout=START_S,
            setup_kwargs={"count_file": str(count)},
        )
        assert_matches_emt(images, results)
        assert PLUGIN_NAME in client.run_on_scheduler(_plugin_names)
        loads = setups(count)
        assert len(loads) == 1
        assert loads[0]["ppid"] in worker_pids(client)
        assert loads[0]["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")
    finally:
        close_client(client)


@pytest.mark.timeout(BUILD_S + 2 * ARRIVE_S + 2 * RUN_S + 2 * CLOSE_S + GONE_S)
def test_killed_worker_chunks_run_again(fake_built_root: Path, tmp_path: Path):
    """SIGKILL one Dask worker process mid-chunk: every index comes back once with
    EMT's values (allowed-failures reran its chunk); the nanny's new worker loads the
    model once more (2 + 1 loads); no Rootstock worker outlives the cluster."""
    client = dask_local_client(workers=2)
    count, trace = tmp_path / "count.jsonl", tmp_path / "trace.jsonl"
    seen_pids: set[int] = set()
    try:
        client.wait_for_workers(2, timeout=ARRIVE_S)
        batch = 10  # 10 x 0.05 s: each chunk runs about half a second, unloaded
        kwargs = {
            "root": fake_built_root,
            "start_timeout": START_S,
            "executor": client,
            "batch_size": batch,
            "setup_kwargs": {"count_file": str(count), "delay": 0.05, "trace_file": str(trace)},
        }
        done = threading.Event()
        killed: list[int | None] = []
        killer = threading.Thread(
            target=lambda: killed.append(kill_one_mid_chunk(count, trace, batch, 2, done)),
            daemon=True,
        )
        killer.start()
        images = cu_cells(80)
        try:
            streamed = list(rootstock.evaluate_iter(images, checkpoint="count-emt", **kwargs))
        finally:
            done.set()
            killer.join(timeout=60)
        assert killed and killed[0] is not None, (
            "no worker was killed: the run ended before both workers had loaded the "
            "model and one was caught mid-chunk"
        )
        assert sorted(index for index, _ in streamed) == list(range(80))
        assert_matches_emt(images, [result for _, result in sorted(streamed, key=lambda x: x[0])])

        # The nanny restarts the killed worker, in its own time on a loaded machine;
        # once it has run a chunk it has loaded the model exactly once, and the
        # surviving worker never loaded it again.
        client.wait_for_workers(2, timeout=ARRIVE_S)
        assert killed[0] not in worker_pids(client)
        more = cu_cells(40, seed=200)
        small_chunks = {**kwargs, "batch_size": 5}  # 8 chunks: both workers get some
        assert_matches_emt(more, rootstock.evaluate(more, checkpoint="count-emt", **small_chunks))
        loads = setups(count)
        assert len(loads) == 3, loads
        assert {load["ppid"] for load in loads[2:]} <= worker_pids(client)
        seen_pids = {load["pid"] for load in loads}
    finally:
        close_client(client)
    assert wait_gone(seen_pids) == set()


@pytest.mark.timeout(BUILD_S + ARRIVE_S + RUN_S + 2 * CLOSE_S + GONE_S)
def test_chunk_killed_past_allowed_failures_is_an_engine_error(
    fake_built_root: Path, tmp_path: Path
):
    """With allowed-failures 0, the death of the worker running a chunk is final:
    EngineError names the chunk and says its worker died (Dask's KilledWorker)."""
    import dask

    count, trace = tmp_path / "count.jsonl", tmp_path / "trace.jsonl"
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        client = dask_local_client(workers=1)
    seen_pids: set[int] = set()
    try:
        client.wait_for_workers(1, timeout=ARRIVE_S)
        batch = 10
        done = threading.Event()
        killer = threading.Thread(
            target=kill_one_mid_chunk, args=(count, trace, batch, 1, done), daemon=True
        )
        killer.start()
        try:
            with pytest.raises(EngineError, match=r"gave up on chunk rootstock-chunk-\d+-.*died"):
                rootstock.evaluate(
                    cu_cells(20),
                    checkpoint="count-emt",
                    root=fake_built_root,
                    executor=client,
                    batch_size=batch,
                    start_timeout=START_S,
                    setup_kwargs={
                        "count_file": str(count),
                        "delay": 0.05,
                        "trace_file": str(trace),
                    },
                )
        finally:
            done.set()
            killer.join(timeout=60)
        seen_pids = {load["pid"] for load in setups(count)}
    finally:
        close_client(client)
    assert wait_gone(seen_pids) == set()
