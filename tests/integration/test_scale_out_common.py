"""rootstock.parallel, engine-neutral: missing extras, bad input refused before
anything starts, the ready-made Parsl config as built, the warm cache's keys, and
chunks bounded in flight on a real Dask LocalCluster (one worker, 127.0.0.1 only).

The engine-specific behaviour (warm workers, pinning, faults, SLURM) has its own
modules; this one shares one single-worker LocalCluster between its tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import parsl
import pytest
from ase.build import bulk
from parsl.config import Config
from parsl.errors import NoDataFlowKernelError
from parsl.executors import HighThroughputExecutor
from parsl.providers import SlurmProvider

import rootstock
from rootstock import RootstockCalculator
from rootstock.errors import CheckpointNotDeclared, UsageError
from rootstock.parallel import dask_local_client, parsl_slurm_config
from rootstock.parallel.warm import WarmCache

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]


def _cells(count: int) -> list:
    images = []
    for seed in range(count):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.rattle(0.05, seed=seed)
        images.append(atoms)
    return images


@pytest.fixture(scope="module")
def client() -> Iterator:
    """One LocalCluster worker process, one thread, bound to 127.0.0.1."""
    client = dask_local_client(workers=1)
    try:
        yield client
    finally:
        client.close()
        client.cluster.close()


def _active_tasks(client) -> list[str]:
    def active(dask_scheduler) -> list[str]:
        return [
            str(key)
            for key, task in dask_scheduler.tasks.items()
            if task.state in ("waiting", "queued", "no-worker", "processing")
        ]

    return client.run_on_scheduler(active)


def _scheduler_task_count(client) -> int:
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))


# --- missing extras --------------------------------------------------------------------

BLOCKED_IMPORT = """
import sys
sys.modules[{module!r}] = None  # `import {module}` now raises ImportError
try:
    from rootstock.parallel import {name}
except Exception as exc:
    print(type(exc).__name__)
    print(exc)
else:
    print("imported")
"""


@pytest.mark.parametrize(
    ("module", "name", "extra"),
    [
        ("parsl", "parsl_slurm_config", "parsl"),
        ("parsl", "shutdown", "parsl"),
        ("distributed", "dask_slurm_client", "dask"),
        ("dask_jobqueue", "RootstockPlugin", "dask"),
    ],
)
def test_a_missing_extra_is_an_error_naming_its_pip_install(
    module: str, name: str, extra: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED_IMPORT.format(module=module, name=name)],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    kind, _, message = proc.stdout.partition("\n")
    assert kind == "MissingExtra", proc.stdout
    assert f"pip install 'rootstock[{extra}]'" in message
    assert repr(module) in message


# --- bad input before anything starts ---------------------------------------------------


def _no_parsl_loaded() -> bool:
    try:
        parsl.dfk()
    except NoDataFlowKernelError:
        return True
    return False


@pytest.mark.parametrize("executor", ["dask", 2, object()])
def test_an_unknown_executor_is_a_usage_error_naming_the_supported_ones(
    fake_built_root: Path, executor: object
) -> None:
    with pytest.raises(UsageError) as info:
        rootstock.evaluate(_cells(2), checkpoint="emt", root=fake_built_root, executor=executor)
    for supported in ("parsl.config.Config", "DataFlowKernel", "distributed.Client"):
        assert supported in str(info.value)
    with pytest.raises(UsageError):
        rootstock.evaluate_iter(_cells(2), "emt", root=fake_built_root, executor=executor)


@pytest.mark.parametrize(
    ("keyword", "value", "match"),
    [
        ("max_in_flight", 0, "max_in_flight must be a positive integer"),
        ("max_in_flight", -3, "max_in_flight must be a positive integer"),
        ("max_in_flight", 1.5, "max_in_flight must be a positive integer"),
        ("max_in_flight", True, "max_in_flight must be a positive integer"),
        ("start_timeout", 0, "start_timeout must be a positive number"),
        ("start_timeout", -1.0, "start_timeout must be a positive number"),
    ],
)
def test_max_in_flight_and_start_timeout_are_checked_before_the_engine_opens(
    fake_built_root: Path, keyword: str, value: object, match: str
) -> None:
    config = Config()  # would load a ThreadPool executor if it got that far
    with pytest.raises(UsageError, match=match):
        rootstock.evaluate(
            _cells(2), checkpoint="emt", root=fake_built_root, executor=config, **{keyword: value}
        )
    assert _no_parsl_loaded()


def test_a_checkpoint_that_is_not_installed_fails_before_any_task(
    fake_built_root: Path, client, tmp_path: Path
) -> None:
    before = _scheduler_task_count(client)
    with pytest.raises(CheckpointNotDeclared):
        rootstock.evaluate(
            _cells(4), checkpoint="no-such-model-1.0", root=fake_built_root, executor=client
        )
    with pytest.raises(CheckpointNotDeclared):
        rootstock.evaluate_iter(_cells(4), "no-such-model-1.0", root=fake_built_root,
                                executor=client)  # fmt: skip
    assert _scheduler_task_count(client) == before
    assert _active_tasks(client) == []


# --- the ready-made Parsl config, as built (SlurmProvider runs sacct when made) -------


def _htex(config: Config) -> HighThroughputExecutor:
    (executor,) = config.executors
    assert isinstance(executor, HighThroughputExecutor)
    return executor


def test_parsl_slurm_config_with_gpus() -> None:
    config = parsl_slurm_config(
        account="m1234",
        partition="gpu",
        walltime="01:00:00",
        nodes=4,
        gpus_per_node=4,
        address="127.0.0.1",
        retries=3,
        heartbeat_period=2,
    )
    executor = _htex(config)
    assert config.retries == 3
    assert executor.address == "127.0.0.1"
    assert [str(a) for a in executor.available_accelerators] == ["0", "1", "2", "3"]
    assert executor.heartbeat_period == 2
    assert executor.heartbeat_threshold == 8
    provider = executor.provider
    assert isinstance(provider, SlurmProvider)
    assert (provider.account, provider.partition, provider.walltime) == (
        "m1234",
        "gpu",
        "01:00:00",
    )
    assert provider.gpus_per_node == 4
    assert provider.exclusive is True
    assert (provider.nodes_per_block, provider.init_blocks, provider.max_blocks) == (1, 4, 4)
    assert provider.worker_init.strip() == f"source {sys.prefix}/bin/activate"
    assert _no_parsl_loaded()


def test_parsl_slurm_config_on_cpus() -> None:
    config = parsl_slurm_config(
        account=None,
        partition="debug",
        walltime="00:10:00",
        nodes=1,
        workers_per_node=2,
        worker_init="module load python; source /shared/venv/bin/activate",
        exclusive=False,
        heartbeat_threshold=5,
    )
    executor = _htex(config)
    assert config.retries == 2
    assert not executor.available_accelerators
    assert executor.max_workers_per_node == 2
    assert executor.heartbeat_threshold == 5
    provider = executor.provider
    assert isinstance(provider, SlurmProvider)
    assert provider.exclusive is False
    assert provider.gpus_per_node is None
    assert provider.worker_init.strip() == "module load python; source /shared/venv/bin/activate"


def test_parsl_slurm_config_rejects_zero_gpus() -> None:
    with pytest.raises(UsageError, match="gpus_per_node"):
        parsl_slurm_config(
            account=None, partition="gpu", walltime="1:00:00", nodes=1, gpus_per_node=0
        )


# --- the warm cache's keys (templates are resolved, never started) --------------------


def test_warm_cache_keys_by_worker(fake_built_root: Path, tmp_path: Path) -> None:
    counted = {"count_file": str(tmp_path / "a.jsonl")}

    def template(setup_kwargs: dict, **options) -> RootstockCalculator:
        return RootstockCalculator(
            "count-emt", root=fake_built_root, device="cpu", setup_kwargs=setup_kwargs,
            **options,
        )  # fmt: skip

    cache = WarmCache()
    first = template(counted, timeout=30.0, batch_size=8)
    assert cache.calculator(first) is first
    again = template(dict(counted), timeout=5.0, batch_size=3, max_atoms_per_chunk=100)
    assert cache.calculator(again) is first
    assert len(cache) == 1
    # Per-call options follow the latest template.
    assert (first.timeout, first.batch_size, first.max_atoms_per_chunk) == (5.0, 3, 100)
    other = template({"count_file": str(tmp_path / "b.jsonl")})
    assert cache.calculator(other) is other
    assert len(cache) == 2
    cache.close()
    assert len(cache) == 0
    assert first.worker_pid is None and other.worker_pid is None
    assert not (tmp_path / "a.jsonl").exists()  # nothing was ever started


# --- chunks bounded in flight on a real cluster ------------------------------------------


class CountingInput:
    """A generator of cells that records how many the consumer has pulled."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.pulled = 0

    def __iter__(self) -> Iterator:
        for atoms in _cells(self.count):
            self.pulled += 1
            yield atoms


def test_chunks_in_flight_are_bounded_and_the_input_is_read_lazily(
    fake_built_root: Path, client, tmp_path: Path
) -> None:
    source = CountingInput(40)
    stream = rootstock.evaluate_iter(
        iter(source), "count-emt", root=fake_built_root, executor=client, batch_size=4,
        max_in_flight=2,
        setup_kwargs={"count_file": str(tmp_path / "count.jsonl"), "delay": 0.05},
    )  # fmt: skip
    index, result = next(stream)
    # Two chunks submitted and one read ahead, at most; never the whole input.
    assert source.pulled <= (2 + 1) * 4
    seen = {index: result["energy"]}
    for index, result in stream:
        assert index not in seen
        seen[index] = result["energy"]
    assert source.pulled == 40
    assert sorted(seen) == list(range(40))
    loads = (tmp_path / "count.jsonl").read_text().splitlines()
    assert len(loads) == 1  # one engine worker, one model load for 10 chunks
    assert json.loads(loads[0])["cuda_visible_devices"] is None


def test_closing_the_iterator_early_leaves_no_task_running(
    fake_built_root: Path, client, tmp_path: Path
) -> None:
    source = CountingInput(200)
    stream = rootstock.evaluate_iter(
        iter(source), "count-emt", root=fake_built_root, executor=client, batch_size=4,
        max_in_flight=3,
        setup_kwargs={"count_file": str(tmp_path / "count.jsonl"), "delay": 0.2},
    )  # fmt: skip
    next(stream)
    assert _active_tasks(client), "chunks should still be in flight"
    stream.close()
    deadline = time.monotonic() + 30
    while _active_tasks(client) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _active_tasks(client) == []
    assert source.pulled < 200
    # The worker is free again: a fresh evaluation runs on it at once.
    results = rootstock.evaluate(_cells(3), checkpoint="emt", root=fake_built_root,
                                 executor=client, batch_size=2)  # fmt: skip
    assert len(results) == 3
