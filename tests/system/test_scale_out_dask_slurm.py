"""rootstock.evaluate on dask-jobqueue's SLURMCluster, with real batch jobs on the
local SLURM (scripts/dev/slurm-up: one node, 2 CPUs, no accounting).

"2 workers" there is one job with two worker processes (``workers_per_node=2``),
``exclusive=False``, one thread each. The scheduler and the workers bind to
127.0.0.1 only. Every test names its jobs uniquely and cancels them in teardown;
after each test no job of that name is left in the queue.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

import rootstock
from rootstock.errors import EngineError
from rootstock.parallel import dask_slurm_client  # the [dask] extra: never skipped
from tests.integration.conftest import TEST_ENVS, build_real_root

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("slurm")]
# The first test also waits for the root build (real uv); jobs start in seconds on an
# idle node, but another test may hold its 2 CPUs for a while.
BUILD_AND_RUN_S = 900
QUEUE_WAIT_S = 300


@pytest.fixture(scope="module")
def count_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """A root with the count-emt env, built by real uv, shared by this module."""
    return build_real_root(
        tmp_path_factory.mktemp("dask-slurm") / "root",
        {"count-emt": TEST_ENVS / "count_emt.py"},
        shared_uv_cache,
    )


def our_jobs(job_name: str) -> list[str]:
    """squeue's lines for the jobs named ``job_name`` (any state still queued)."""
    proc = subprocess.run(
        ["squeue", "-h", "-n", job_name, "-o", "%i %T"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return proc.stdout.strip().splitlines()


def assert_no_jobs_left(job_name: str, timeout: float = 30) -> None:
    """No job named ``job_name`` is queued or running (cancelled ones leave in seconds)."""
    deadline = time.monotonic() + timeout
    while our_jobs(job_name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert our_jobs(job_name) == []


@pytest.fixture
def job_name() -> Iterator[str]:
    """A job name of this test's own; teardown cancels whatever still has it."""
    name = f"rs-dask-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", "-n", name], capture_output=True, timeout=30, check=False)
    assert_no_jobs_left(name)


def slurm_kwargs(job_name: str, log_dir: Path, **extra: Any) -> dict[str, Any]:
    """Keywords for the local SLURM: 1 node, 2 CPU workers, 127.0.0.1 only."""
    cluster_kwargs = {
        "worker_extra_args": ["--host", "127.0.0.1"],
        "log_directory": str(log_dir),
        "job_name": job_name,
        **extra,
    }
    return {
        "account": None,
        "partition": "gpu",
        "walltime": "00:10:00",
        "nodes": 1,
        "workers_per_node": 2,
        "exclusive": False,
        "address": "127.0.0.1",
        "cluster_kwargs": cluster_kwargs,
    }


def close_client(client: Any) -> None:
    """Close the client and its SLURMCluster (which cancels its jobs)."""
    cluster = client.cluster
    with contextlib.suppress(Exception):
        client.close(timeout=30)
    with contextlib.suppress(Exception):
        cluster.close(timeout=60)


def cu_cells(n: int) -> list[Any]:
    cells = []
    for i in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * ((1, 1, 2) if i % 2 else (1, 1, 1))
        atoms.rattle(0.05, seed=i)
        cells.append(atoms)
    return cells


@pytest.mark.timeout(BUILD_AND_RUN_S)
def test_slurm_job_with_two_workers(count_root: Path, job_name: str, tmp_path: Path):
    """One real batch job with 2 Dask worker processes evaluates like in-process EMT,
    loading the model once per worker; the job script is what the knobs ask for."""
    count = tmp_path / "count.jsonl"
    client = dask_slurm_client(**slurm_kwargs(job_name, tmp_path / "logs"))
    try:
        script = client.cluster.job_script()
        assert "--nworkers 2" in script
        assert f"source {sys.prefix}/bin/activate" in script
        assert "#SBATCH --mem" not in script
        assert "#SBATCH --exclusive" not in script
        assert "--host 127.0.0.1" in script
        assert len(our_jobs(job_name)) == 1  # submitted by the constructor

        # Both workers idle before the first chunks go out, so each gets some: a worker
        # that arrives after the others have taken every chunk never loads the model.
        client.wait_for_workers(2, timeout=QUEUE_WAIT_S)
        images = cu_cells(24)
        results = rootstock.evaluate(
            images,
            checkpoint="count-emt",
            root=count_root,
            executor=client,
            batch_size=3,
            start_timeout=QUEUE_WAIT_S,
            setup_kwargs={"count_file": str(count)},
        )
        for atoms, result in zip(images, results, strict=True):
            ref = atoms.copy()
            ref.calc = EMT()
            assert result["energy"] == pytest.approx(ref.get_potential_energy(), abs=1e-10)
            np.testing.assert_allclose(result["forces"], ref.get_forces(), rtol=0, atol=1e-10)
            np.testing.assert_allclose(result["stress"], ref.get_stress(), rtol=0, atol=1e-10)
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        assert len(names) == 2 and names[0].endswith("-0") and names[1].endswith("-1"), names
        loads = [json.loads(line) for line in count.read_text().splitlines()]
        assert len(loads) == 2, loads
        assert len({load["ppid"] for load in loads}) == 2
    finally:
        close_client(client)
    assert client.status == "closed"
    assert_no_jobs_left(job_name)


@pytest.mark.timeout(120)
def test_refused_sbatch_names_its_message(job_name: str, tmp_path: Path):
    """sbatch refusing the job (an unknown partition) raises EngineError with
    sbatch's own words, and leaves no cluster behind."""
    kwargs = slurm_kwargs(job_name, tmp_path / "logs")
    kwargs["partition"] = "nope"
    with pytest.raises(EngineError, match=r"could not submit .*invalid partition") as info:
        dask_slurm_client(**kwargs)
    assert "sbatch: error" in str(info.value)
    assert_no_jobs_left(job_name)


@pytest.mark.timeout(BUILD_AND_RUN_S)
def test_no_worker_in_time_names_the_queue_state(count_root: Path, job_name: str, tmp_path: Path):
    """A job held in the queue (``--begin`` an hour away): after start_timeout,
    EngineError names squeue's state and reason; closing cancels the job."""
    count = tmp_path / "count.jsonl"
    client = dask_slurm_client(
        **slurm_kwargs(job_name, tmp_path / "logs", job_extra_directives=["--begin=now+1hour"])
    )
    try:
        assert len(our_jobs(job_name)) == 1
        started = time.monotonic()
        with pytest.raises(EngineError, match=r"no Dask worker arrived within 8 s") as info:
            rootstock.evaluate(
                cu_cells(4),
                checkpoint="count-emt",
                root=count_root,
                executor=client,
                start_timeout=8,
                setup_kwargs={"count_file": str(count)},
            )
        assert 8 <= time.monotonic() - started < 30
        assert "PENDING BeginTime" in str(info.value)
        assert not count.exists()
    finally:
        close_client(client)
    assert client.status == "closed"
    assert_no_jobs_left(job_name)
