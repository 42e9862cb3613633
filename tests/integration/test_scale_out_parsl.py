"""rootstock.evaluate on real Parsl (HTEX on a LocalProvider, bound to 127.0.0.1):
equality with in-process EMT, one setup() per engine worker with GPU pinning read in
the worker, a SIGKILLed engine worker retried without duplicates, errors=, and the
one-config-per-process rules.

The ``count-emt`` env records every ``setup()`` (pid, parent pid, CUDA_VISIBLE_DEVICES)
in a count file; all tests use the same setup keywords, so one warm worker per engine
worker serves every test of the module. The tests run in file order: the first two
need no config loaded, the last ones shut the shared one down.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import parsl
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from parsl.config import Config
from parsl.errors import NoDataFlowKernelError

import rootstock
from rootstock.errors import UsageError, WorkerError
from rootstock.parallel import parsl_local_config, shutdown
from tests.integration.killing import is_running

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

CLOSE = {"rtol": 0, "atol": 1e-10}
BATCH = 4
# 4 structures x 0.1 s: a chunk runs long enough to be killed mid-way.
DELAY = 0.1
# On a loaded machine (CI runners share their cores with other jobs) starting an HTEX
# worker, or restarting a killed one, may take minutes instead of seconds. So every
# wait polls its condition under a generous deadline and assumes no start-up time;
# each test's timeout is the sum of its waits, so a stuck wait fails first.
START_S = 300  # evaluate's start_timeout: a first engine worker to arrive
WARM_S = 300  # every engine worker to have loaded the model, runs going on meanwhile
WATCH_S = 300  # the victim of the kill test, to be caught inside a chunk
RUN_S = 120  # one evaluate of 40 structures on workers that are up (seconds, unloaded)
GONE_S = 300  # Rootstock workers, to exit once Parsl is shut down
# How long the interchange waits for a manager's heartbeat before it counts the
# manager (and its workers' tasks) as lost: Parsl's default, 4 heartbeat periods,
# is 8 s here, which a manager on a loaded machine can miss.
HEARTBEAT_THRESHOLD_S = 120


def cells(n: int = 40) -> list[Atoms]:
    """Rattled Cu cells of two sizes (4 and 8 atoms), alternating."""
    images = []
    for i in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * ((1, 1, 1) if i % 2 else (1, 1, 2))
        atoms.rattle(0.05, seed=i)
        images.append(atoms)
    return images


def reference(images: list[Atoms]) -> list[dict[str, np.ndarray]]:
    out = []
    for atoms in images:
        atoms = atoms.copy()
        atoms.calc = EMT()
        out.append(
            {
                "energy": atoms.get_potential_energy(),
                "forces": atoms.get_forces(),
                "stress": atoms.get_stress(),
            }
        )
    return out


def assert_matches(results: list[Any], images: list[Atoms]) -> None:
    assert len(results) == len(images)
    for got, want in zip(results, reference(images), strict=True):
        for key in ("energy", "forces", "stress"):
            np.testing.assert_allclose(got[key], want[key], **CLOSE)


def setups(count_file: Path) -> list[dict[str, Any]]:
    """Every setup() call recorded so far."""
    if not count_file.exists():
        return []
    return [json.loads(line) for line in count_file.read_text().splitlines() if line]


def no_dfk() -> bool:
    try:
        parsl.dfk()
    except NoDataFlowKernelError:
        return True
    return False


@pytest.fixture(scope="module")
def count_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parsl-count") / "setups.jsonl"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parsl-trace") / "calculations.jsonl"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Iterator[Config]:
    """Two HTEX workers pinned to "GPUs" 0 and 1; loaded by the first evaluate."""
    run_dir = tmp_path_factory.mktemp("parsl-runinfo")
    # A 2 s heartbeat period: the pool's watchdog restarts a dead worker within one.
    cfg = parsl_local_config(
        workers=2,
        gpus=2,
        heartbeat_period=2,
        heartbeat_threshold=HEARTBEAT_THRESHOLD_S,
        run_dir=str(run_dir),
    )
    yield cfg
    shutdown()


@pytest.fixture
def kwargs(fake_built_root, count_file, trace_file) -> dict[str, Any]:
    return {
        "checkpoint": "count-emt",
        "root": fake_built_root,
        "batch_size": BATCH,
        "start_timeout": START_S,
        "setup_kwargs": {
            "count_file": str(count_file),
            "delay": DELAY,
            "trace_file": str(trace_file),
        },
    }


@pytest.mark.timeout(600)  # may wait for the session's env builds
def test_empty_input_returns_nothing_and_loads_no_config(kwargs, tmp_path):
    cfg = parsl_local_config(workers=1, run_dir=str(tmp_path))
    assert rootstock.evaluate([], executor=cfg, **kwargs) == []
    assert list(rootstock.evaluate_iter(iter([]), executor=cfg, **kwargs)) == []
    assert no_dfk()


@pytest.mark.timeout(60)
def test_uninstalled_checkpoint_fails_before_any_config_loads(kwargs, tmp_path):
    cfg = parsl_local_config(workers=1, run_dir=str(tmp_path))
    kwargs["checkpoint"] = "no-such-model"
    with pytest.raises(UsageError) as info:
        rootstock.evaluate(cells(2), executor=cfg, **kwargs)
    assert "no-such-model" in str(info.value)
    assert no_dfk()
    assert not list(tmp_path.iterdir()), "Parsl wrote a run directory"


@pytest.mark.timeout(START_S + 4 * RUN_S + WARM_S)
def test_matches_emt_with_one_setup_per_pinned_worker(config, kwargs, count_file):
    images = cells(40)
    first = rootstock.evaluate(images, executor=config, **kwargs)
    assert_matches(first, images)
    again = rootstock.evaluate(images, executor=config, **kwargs)
    assert_matches(again, images)

    seen = [index for index, _ in rootstock.evaluate_iter(images, executor=config, **kwargs)]
    assert sorted(seen) == list(range(len(images)))

    # An engine worker takes chunks once it has started, which on a loaded machine
    # may be after the other one ran all of the above: run on until both have.
    deadline = time.monotonic() + WARM_S
    while len(setups(count_file)) < 2 and time.monotonic() < deadline:
        assert_matches(rootstock.evaluate(images, executor=config, **kwargs), images)

    # 3 or more x 10 chunks ran; the model loaded once in each of the two engine workers.
    calls = setups(count_file)
    assert len(calls) == 2, calls
    assert len({c["ppid"] for c in calls}) == 2
    assert sorted(c["cuda_visible_devices"] for c in calls) == ["0", "1"]


@pytest.mark.timeout(START_S + 2 * RUN_S)
def test_errors_raise_names_the_structure_or_fill_its_slot(config, kwargs, count_file):
    before = len(setups(count_file))
    images = cells(12)
    images[5].numbers[0] = 92  # EMT has no uranium
    with pytest.raises(WorkerError, match=r"structure 5\b"):
        rootstock.evaluate(images, executor=config, **kwargs)

    results = rootstock.evaluate(images, executor=config, errors="return", **kwargs)
    assert isinstance(results[5], WorkerError)
    assert "structure 5" in str(results[5])
    others = [i for i in range(len(images)) if i != 5]
    assert not any(isinstance(results[i], WorkerError) for i in others)
    assert_matches([results[i] for i in others], [images[i] for i in others])
    assert len(setups(count_file)) == before  # a model error keeps the worker warm


@pytest.mark.timeout(START_S + 2 * RUN_S)
def test_one_config_per_process(config, kwargs, count_file, tmp_path):
    before = len(setups(count_file))
    images = cells(8)
    # The same Config object again: the loaded DataFlowKernel, its warm workers.
    assert_matches(rootstock.evaluate(images, executor=config, **kwargs), images)
    dfk = parsl.dfk()
    # A DataFlowKernel loaded already is used as given.
    assert_matches(rootstock.evaluate(images, executor=dfk, **kwargs), images)
    assert parsl.dfk() is dfk
    assert len(setups(count_file)) == before

    other = parsl_local_config(workers=1, run_dir=str(tmp_path))
    with pytest.raises(UsageError) as info:
        rootstock.evaluate(images, executor=other, **kwargs)
    assert "one loaded config per process" in str(info.value)
    assert "rootstock.parallel.shutdown()" in (info.value.hint or "")
    assert parsl.dfk() is dfk


def started_calculations(trace_file: Path, pid: int, since: float) -> int:
    """How many calculations the Rootstock worker ``pid`` started after ``since``."""
    lines = trace_file.read_text().splitlines() if trace_file.exists() else []
    # A line may still be half written: only whole lines count.
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return sum(1 for r in records if r["pid"] == pid and r["t"] > since)


def kill_inside_a_task(
    workers: list[dict[str, Any]],
    trace_file: Path,
    since: float,
    stream: concurrent.futures.Future,
) -> dict[str, Any]:
    """SIGKILL the first of the engine ``workers`` (their setup records) caught surely
    inside a task of the run that started at ``since``; return its record.

    Killed between tasks, an HTEX worker may die holding the lock of its manager's
    shared task queue, and the manager's other workers then never get a task again:
    a Parsl limitation, not what this test is about. Inside a task it waits on its
    Rootstock worker's socket and holds no lock.

    Decided by count while its Rootstock worker is stopped (SIGSTOP), so no
    timing is assumed, however loaded the machine: with k calculations started in this
    run (one per structure) and k not a multiple of BATCH, its chunk still has
    structures to compute, each sleeping DELAY, so its task cannot have finished.
    """
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline and not stream.done():
        for worker in workers:
            # Only a worker that looks mid-chunk is stopped for the exact check.
            if not started_calculations(trace_file, worker["pid"], since) % BATCH:
                continue
            os.kill(worker["pid"], signal.SIGSTOP)
            try:
                if started_calculations(trace_file, worker["pid"], since) % BATCH:
                    os.kill(worker["ppid"], signal.SIGKILL)
                    return worker
            finally:
                os.kill(worker["pid"], signal.SIGCONT)
        time.sleep(0.005)
    if stream.done():
        stream.result()  # its error, if it failed
        pytest.fail("the run ended before an engine worker was caught inside a chunk")
    pytest.fail(f"no engine worker was caught inside a chunk within {WATCH_S} s")


@pytest.mark.timeout(WATCH_S + RUN_S + WARM_S + 2 * RUN_S)
def test_killed_engine_worker_is_retried_and_restarted(config, kwargs, count_file, trace_file):
    calls = setups(count_file)
    assert len(calls) == 2
    images = cells(40)
    results: dict[int, Any] = {}
    repeated: list[int] = []

    def consume() -> None:
        for index, result in rootstock.evaluate_iter(images, executor=config, **kwargs):
            if index in results:
                repeated.append(index)
            results[index] = result

    # The stream runs in a thread, so chunks keep flowing while the victim is watched.
    # Calculations traced after ``since`` are this run's: taken before it starts.
    since = time.time()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(consume)
        victim = kill_inside_a_task(calls, trace_file, since, stream)
        stream.result(timeout=RUN_S)
    assert not repeated, f"indices {repeated} came twice"
    assert sorted(results) == list(range(len(images)))
    assert_matches([results[i] for i in range(len(images))], images)

    # The pool's watchdog restarts a dead worker (same slot, same GPU) within a
    # heartbeat period, and the replacement starts in its own time, which on a loaded
    # machine may outlast several runs: run until it has loaded the model.
    deadline = time.monotonic() + WARM_S
    while len(setups(count_file)) < 3 and time.monotonic() < deadline:
        assert_matches(rootstock.evaluate(images, executor=config, **kwargs), images)
    # One more run on the warm workers loads nothing: two workers plus one restart,
    # not one setup per task (10 a run).
    assert_matches(rootstock.evaluate(images, executor=config, **kwargs), images)
    calls = setups(count_file)
    assert len(calls) == 3, calls
    assert len({c["ppid"] for c in calls}) == 3
    assert calls[2]["cuda_visible_devices"] == victim["cuda_visible_devices"]
    assert not is_running(victim["ppid"])


@pytest.mark.timeout(GONE_S + START_S + 2 * RUN_S)  # and two shutdowns
def test_after_shutdown_no_worker_is_left_and_a_new_config_loads(
    config, kwargs, count_file, tmp_path
):
    warm = [c["pid"] for c in setups(count_file)]
    shutdown()
    assert no_dfk()
    deadline = time.monotonic() + GONE_S
    while any(is_running(pid) for pid in warm) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in warm if is_running(pid)], "a rootstock worker outlived Parsl"

    other = parsl_local_config(
        workers=1,
        heartbeat_period=2,
        heartbeat_threshold=HEARTBEAT_THRESHOLD_S,
        run_dir=str(tmp_path),
    )
    try:
        images = cells(4)
        assert_matches(rootstock.evaluate(images, executor=other, **kwargs), images)
        assert parsl.dfk().config is other
    finally:
        shutdown()
    assert no_dfk()
