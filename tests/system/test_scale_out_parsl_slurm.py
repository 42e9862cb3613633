"""rootstock.evaluate on Parsl's SlurmProvider, on the local SLURM (scripts/dev/slurm-up):
real batch jobs whose HTEX workers reach this process on 127.0.0.1.

That SLURM has 2 CPUs and other tests may hold them, so every test waits for its
job rather than assuming it runs at once. Teardown shuts the config down (Parsl
cancels its blocks) and checks that no job of this module is left in the queue.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import parsl
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT
from parsl.errors import NoDataFlowKernelError

import rootstock
from rootstock.errors import EngineError, UsageError
from rootstock.parallel import parsl_slurm_config, shutdown
from tests.integration.conftest import TEST_ENVS, build_real_root
from tests.system.slurm_chain import slurm_cmd

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]


def our_jobs(run_dir: Path) -> list[tuple[str, str]]:
    """``(job id, state)`` of every job in the queue whose batch script Parsl wrote
    under ``run_dir`` (other tests may use the same SLURM at the same time)."""
    out = slurm_cmd("squeue", "-h", "-o", "%i|%T|%o")
    jobs = [line.split("|", 2) for line in out.splitlines() if line]
    return [(job, state) for job, state, script in jobs if script.startswith(f"{run_dir}/")]


def no_dfk() -> bool:
    try:
        parsl.dfk()
    except NoDataFlowKernelError:
        return True
    return False


def config(run_dir: Path, **overrides: Any):
    knobs: dict[str, Any] = {
        "account": None,
        "partition": "gpu",
        "walltime": "00:10:00",
        "nodes": 1,
        "workers_per_node": 2,
        "exclusive": False,
        "address": "127.0.0.1",
        "heartbeat_period": 2,
        "run_dir": str(run_dir),
    }
    return parsl_slurm_config(**{**knobs, **overrides})


@pytest.fixture(scope="module")
def count_root(tmp_path_factory, shared_uv_cache: Path, slurm) -> Path:
    """A root with only the count-emt env, built by real uv."""
    return build_real_root(
        tmp_path_factory.mktemp("parsl-slurm") / "root",
        {"count-emt": TEST_ENVS / "count_emt.py"},
        shared_uv_cache,
    )


@pytest.fixture
def clean_queue(slurm, tmp_path) -> Iterator[None]:
    """Shut the loaded config down after the test; no job of its run directory (under
    ``tmp_path``) may be left in the queue."""
    try:
        yield
    finally:
        shutdown()
        deadline = time.monotonic() + 30
        while our_jobs(tmp_path) and time.monotonic() < deadline:
            time.sleep(1)
        left = our_jobs(tmp_path)
        for job, _ in left:
            slurm_cmd("scancel", job)
        assert not left, f"jobs left in the queue: {left}"


@pytest.mark.timeout(600)  # may wait for the env build
def test_uninstalled_checkpoint_fails_before_any_job(count_root, clean_queue, tmp_path):
    with pytest.raises(UsageError, match="no-such-model"):
        rootstock.evaluate(
            [bulk("Cu", cubic=True)], "no-such-model", root=count_root,
            executor=config(tmp_path),
        )  # fmt: skip
    assert no_dfk()
    assert not our_jobs(tmp_path)
    assert not list(tmp_path.iterdir()), "Parsl wrote a run directory"


@pytest.mark.timeout(60)
def test_refused_sbatch_raises_its_message_quickly(count_root, clean_queue, tmp_path):
    started = time.monotonic()
    with pytest.raises(EngineError) as info:
        rootstock.evaluate(
            [bulk("Cu", cubic=True)], "count-emt", root=count_root,
            executor=config(tmp_path, partition="nope"), start_timeout=600,
        )  # fmt: skip
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert "could not start its workers" in message
    assert "invalid partition" in message.lower(), message  # sbatch's own words


@pytest.mark.timeout(90)
def test_a_job_still_pending_times_out_naming_its_state(count_root, clean_queue, tmp_path):
    cfg = config(tmp_path, scheduler_options="#SBATCH --begin=now+1hour")
    started = time.monotonic()
    with pytest.raises(EngineError) as info:
        rootstock.evaluate(
            [bulk("Cu", cubic=True)], "count-emt", root=count_root, executor=cfg,
            start_timeout=8,
        )  # fmt: skip
    waited = time.monotonic() - started
    assert 8 <= waited < 40
    message = str(info.value)
    assert "no Parsl worker arrived within 8 s" in message
    assert "PENDING" in message, message
    # A job that waits is not a failure: it is still queued until shutdown.
    assert [state for _, state in our_jobs(tmp_path)] == ["PENDING"]


@pytest.mark.timeout(240)
def test_batch_job_with_two_workers_matches_emt(count_root, clean_queue, tmp_path):
    count_file = tmp_path / "setups.jsonl"
    images = []
    for i in range(16):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (1, 1, 1 + i % 2)
        atoms.rattle(0.05, seed=i)
        images.append(atoms)
    results = rootstock.evaluate(
        images, "count-emt", root=count_root, executor=config(tmp_path / "runinfo"),
        batch_size=2, setup_kwargs={"count_file": str(count_file), "delay": 0.1},
        start_timeout=180,
    )  # fmt: skip
    assert len(results) == len(images)
    for got, atoms in zip(results, images, strict=True):
        atoms = atoms.copy()
        atoms.calc = EMT()
        assert got["energy"] == pytest.approx(atoms.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(got["forces"], atoms.get_forces(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["stress"], atoms.get_stress(), rtol=0, atol=1e-10)
    assert [state for _, state in our_jobs(tmp_path)] == ["RUNNING"]

    calls = [json.loads(line) for line in count_file.read_text().splitlines()]
    assert len(calls) == 2, calls  # 8 chunks, two engine workers: one setup each
    assert len({c["ppid"] for c in calls}) == 2
