"""rootstock.parallel without starting an engine: the collector, executor checks,
GPU slots, errors that travel by pickle, and the constructors' argument checks.

Constructing a bare ``parsl.config.Config`` starts nothing (only ``parsl.load``
does); a SlurmProvider runs ``sacct`` as it is made, and a cluster starts
processes, so those are in tests/integration/test_scale_out_common.py.
"""

from __future__ import annotations

import pickle

import pytest
from parsl.config import Config

from rootstock.errors import (
    EngineError,
    EnvFileError,
    RootstockError,
    UsageError,
    WorkerDiedError,
    WorkerError,
)
from rootstock.parallel import dask_engine, dask_slurm_client, parsl_slurm_config
from rootstock.parallel.dispatch import Collector, check_executor, engine_kind
from rootstock.parallel.warm import ChunkTask, WarmCache
from rootstock.runtime.worker_keys import visible_devices

pytestmark = pytest.mark.timeout(30)


def _task(indices: tuple[int, ...]) -> ChunkTask:
    # The collector reads only the indices; the calculator slot is never touched.
    return ChunkTask(None, tuple((i, None) for i in indices), ("energy",))  # type: ignore[arg-type]


def _outcomes(indices: tuple[int, ...]) -> list[tuple[int, object]]:
    return [(i, {"energy": float(i)}) for i in indices]


# --- Collector -------------------------------------------------------------------------


def test_collector_accepts_a_chunk_once_and_drops_its_second_delivery() -> None:
    collector = Collector()
    first = collector.accept(_task((0, 1, 2)), _outcomes((0, 1, 2)))
    assert [i for i, _ in first] == [0, 1, 2]
    assert len(collector) == 1
    # The same chunk again (a retry whose first run was not lost after all).
    assert collector.accept(_task((0, 1, 2)), _outcomes((0, 1, 2))) == []
    assert len(collector) == 1
    other = collector.accept(_task((3, 4)), _outcomes((3, 4)))
    assert [i for i, _ in other] == [3, 4]
    assert len(collector) == 2


def test_collector_refuses_outcomes_for_other_indices() -> None:
    collector = Collector()
    with pytest.raises(EngineError, match=r"other structures than chunk 0\.\.2"):
        collector.accept(_task((0, 1, 2)), _outcomes((0, 1, 5)))
    with pytest.raises(EngineError):
        collector.accept(_task((0, 1, 2)), _outcomes((0, 1)))
    # A refused delivery is not remembered: the right one is still accepted.
    assert len(collector) == 0
    assert len(collector.accept(_task((0, 1, 2)), _outcomes((0, 1, 2)))) == 3


# --- executor checks -------------------------------------------------------------------


def test_a_parsl_config_is_a_parsl_executor() -> None:
    config = Config()
    assert engine_kind(config) == "parsl"
    check_executor(config)  # no error


@pytest.mark.parametrize("executor", ["local", 4, object(), [Config()], {"workers": 2}])
def test_an_executor_of_another_type_is_a_usage_error_naming_the_supported_ones(
    executor: object,
) -> None:
    assert engine_kind(executor) is None
    with pytest.raises(UsageError) as info:
        check_executor(executor)
    text = str(info.value)
    assert type(executor).__name__ in text
    for supported in ("parsl.config.Config", "DataFlowKernel", "distributed.Client"):
        assert supported in text


def test_a_lookalike_type_from_another_module_is_refused() -> None:
    lookalike = type("Client", (), {"__module__": "mypackage.distributed"})()
    assert engine_kind(lookalike) is None
    with pytest.raises(UsageError):
        check_executor(lookalike)


# --- the Dask plugin's GPU slot ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "per_job", "slot"),
    [
        ("SLURMCluster-3-1", 2, 1),
        ("SLURMCluster-3-0", 2, 0),
        ("PBSCluster-0-3", 4, 3),
        (0, 2, 0),
        (1, 2, 1),
        (5, 2, 1),
        ("SLURMCluster-7", 1, 0),  # one process per job: always slot 0
        (3, 1, 0),
        ("SLURMCluster-7", None, 0),
        ("tcp-worker", 2, 0),  # no index in the name
    ],
)
def test_worker_slot(name: object, per_job: int | None, slot: int) -> None:
    assert dask_engine.worker_slot(name, per_job or 0) == slot


# --- the warm cache ------------------------------------------------------------------


def test_warm_cache_pickles_empty() -> None:
    cache = WarmCache()
    cache._calculators["key"] = object()  # type: ignore[assignment]
    copy = pickle.loads(pickle.dumps(cache))
    assert isinstance(copy, WarmCache)
    assert len(copy) == 0
    assert len(cache) == 1


def test_the_dask_plugin_pickles_with_an_empty_cache() -> None:
    plugin = dask_engine.RootstockPlugin(gpus_per_job=2)
    plugin.cache._calculators["key"] = object()  # type: ignore[assignment]
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.gpus_per_job == 2
    assert len(copy.cache) == 0


# --- errors cross process boundaries whole -------------------------------------------


def test_worker_error_survives_pickle_whole() -> None:
    error = WorkerError("structure 3: unknown element Xx", "Traceback ...\nKeyError", "try EMT")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is WorkerError
    assert copy.message == error.message
    assert copy.remote_traceback == "Traceback ...\nKeyError"
    assert copy.hint == "try EMT"
    assert str(copy) == str(error)


def test_worker_died_error_survives_pickle_whole() -> None:
    error = WorkerDiedError("the worker died", -9, output_tail="Killed")
    error.partial_results = [{"energy": 1.0}, {"energy": 2.0}]
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is WorkerDiedError
    assert copy.worker_exit_code == -9
    assert copy.output_tail == "Killed"
    assert copy.partial_results == [{"energy": 1.0}, {"energy": 2.0}]
    assert copy.hint == error.hint
    assert str(copy) == str(error)


def test_env_file_error_survives_pickle_whole() -> None:
    error = EnvFileError("bad env file", problems=["line 3: no setup()", "line 9"], hint="lint")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is EnvFileError
    assert copy.problems == ["line 3: no setup()", "line 9"]
    assert copy.hint == "lint"
    assert str(copy) == str(error)


@pytest.mark.parametrize("cls", [RootstockError, UsageError, EngineError])
def test_plain_errors_survive_pickle_with_their_hint(cls: type[RootstockError]) -> None:
    copy = pickle.loads(pickle.dumps(cls("message", hint="do this")))
    assert type(copy) is cls
    assert (copy.message, copy.hint) == ("message", "do this")


# --- visible devices in the worker key -----------------------------------------------


def test_visible_devices_is_empty_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_devices("cpu") == ""


def test_visible_devices_lists_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert "CUDA_VISIBLE_DEVICES=1" in visible_devices("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert "CUDA_VISIBLE_DEVICES=0" in visible_devices("cuda")
    assert visible_devices("cuda") != visible_devices("cpu")


# --- the ready-made constructors refuse bad input before anything starts ------------
# (SlurmProvider's constructor runs ``sacct``: the built configs are checked in
# tests/integration/test_scale_out_common.py.)


@pytest.mark.parametrize("nodes", [0, -1, True, 1.5])
def test_parsl_slurm_config_rejects_bad_nodes(nodes: object) -> None:
    with pytest.raises(UsageError, match="nodes must be a positive integer"):
        parsl_slurm_config(account=None, partition="gpu", walltime="1:00:00", nodes=nodes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("nodes", "gpus"), [(0, None), (-2, None), (1, 0)])
def test_dask_slurm_client_rejects_bad_arguments_before_starting_anything(
    nodes: int, gpus: int | None
) -> None:
    # A cluster would open a scheduler socket and, on scale, run sbatch (refused here).
    with pytest.raises(UsageError, match="must be a positive integer"):
        dask_slurm_client(
            account=None, partition="gpu", walltime="1:00:00", nodes=nodes, gpus_per_node=gpus
        )
