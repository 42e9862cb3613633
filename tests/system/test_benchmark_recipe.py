"""The one-shot benchmark recipes, unedited: SLURM on the local cluster, PBS by bash.

The SLURM tests need the cluster from ``scripts/dev/slurm-up`` (skipped where SLURM
is not installed, failed where it is installed but not answering) and submit
``scripts/benchmark_gpu.sbatch`` as a maintainer would, with ``DEVICE=cpu`` and
``ROOTSTOCK_VENV`` as the only knobs that make it run here. The PBS recipe needs no
scheduler to test (it queues nothing): bash runs it as a PBS server would, from
``$HOME`` with ``PBS_O_WORKDIR`` set. Both benchmark EMT for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import ENVIRONMENTS, installed_root, run_rootstock
from tests.system.slurm_chain import (
    DEV_VENV,
    TERMINAL_STATES,
    job_info,
    kill_workers_of,
    slurm_cmd,
)

pytestmark = pytest.mark.timeout(420)

REPO = Path(__file__).resolve().parents[2]
SBATCH_RECIPE = REPO / "scripts" / "benchmark_gpu.sbatch"
PBS_RECIPE = REPO / "scripts" / "benchmark_gpu.pbs"
KNOBS = {"DEVICE": "cpu", "SYSTEM": "Cu:32", "CALLS": "5", "WARMUP": "1"}


@pytest.fixture(scope="module")
def bench_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """A root with the sample EMT env built and ``emt`` fetched."""
    path = tmp_path_factory.mktemp("bench-recipe") / "root"
    root = installed_root(path, shared_uv_cache, [ENVIRONMENTS / "emt.py"])
    run_rootstock("add", "emt", "--no-verify", "--root", root, "--no-push", timeout=120)
    yield root
    kill_workers_of(root)


def job_environment(home: Path, root: Path, knobs: dict[str, str]) -> dict[str, str]:
    """The submit-time environment: the test's own, a private HOME, and the knobs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "PBS_", "PYTEST_"))
        and k not in {"CHECKPOINTS", "RESULTS_DIR", "BENCHMARK_ARGS"}
    }
    env.update(HOME=str(home), ROOTSTOCK_ROOT=str(root), ROOTSTOCK_VENV=str(DEV_VENV))
    env.update(knobs)
    return env


def submit(tmp: Path, root: Path, **knobs: str) -> tuple[str, str, Path]:
    """``KNOB=value sbatch benchmark_gpu.sbatch`` from a fresh directory; (id, name, dir)."""
    name = f"rs-bench-{uuid.uuid4().hex[:8]}"
    workdir = tmp / name
    (workdir / "home").mkdir(parents=True)
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={name}", str(SBATCH_RECIPE)],
        cwd=workdir,
        env=job_environment(workdir / "home", root, knobs),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0], name, workdir


def wait_done(job_id: str, name: str, workdir: Path, timeout: float = 300):
    """Wait for the job to finish; its info. Cancels it (and says why) on a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if info.state in TERMINAL_STATES:
            return info
        if time.monotonic() > deadline:
            slurm_cmd("scancel", job_id)
            logs = "\n".join(p.read_text() for p in workdir.glob("*.out"))
            raise AssertionError(f"job {job_id} ({name}) still {info.state}:\n{logs}")
        time.sleep(0.5)


def check_document(doc: dict) -> None:
    """The benchmark JSON the recipes write: one EMT result on 32 atoms."""
    assert doc["device"] == "cpu" and doc["system"]["natoms"] == 32
    assert doc["walk"]["calls"] == 5 and doc["walk"]["warmup"] == 1
    (result,) = doc["results"]
    assert result["checkpoint"] == "emt" and result["max_energy_diff"] < 1e-9
    assert result["calculator"]["median_ms"] > 0 and result["in_env"]["median_ms"] > 0


@pytest.mark.system
def test_sbatch_recipe_writes_the_json_beside_its_log(slurm, bench_root: Path, tmp_path: Path):
    job_id, name, workdir = submit(tmp_path, bench_root, CHECKPOINTS="emt", **KNOBS)
    info = wait_done(job_id, name, workdir)
    log = (workdir / f"{name}-{job_id}.out").read_text()
    assert info.state == "COMPLETED" and info.exit_code == "0:0", log
    result = workdir / f"{name}-{job_id}.json"
    assert f"wrote {result}" in log and "running: rootstock benchmark emt" in log
    check_document(json.loads(result.read_text()))
    assert not list(workdir.glob("*.part"))


@pytest.mark.system
@pytest.mark.parametrize(
    ("checkpoints", "expected"),
    [("emtt", "unknown checkpoint 'emtt'"), ("", "CHECKPOINTS is empty")],
    ids=["unknown-id", "no-ids"],
)
def test_sbatch_recipe_fails_with_the_usage_exit_code(
    slurm, bench_root: Path, tmp_path: Path, checkpoints: str, expected: str
):
    job_id, name, workdir = submit(tmp_path, bench_root, CHECKPOINTS=checkpoints, **KNOBS)
    info = wait_done(job_id, name, workdir)
    log = (workdir / f"{name}-{job_id}.out").read_text()
    assert info.state == "FAILED" and info.exit_code == "2:0", log
    assert expected in log
    assert not list(workdir.glob("*.json")) and not list(workdir.glob("*.part"))


def test_pbs_recipe_writes_the_json_in_the_submit_directory(bench_root: Path, tmp_path: Path):
    home, submit_dir = tmp_path / "home", tmp_path / "submit"
    home.mkdir()
    submit_dir.mkdir()
    env = job_environment(home, bench_root, {"CHECKPOINTS": "emt,", **KNOBS})
    env.update(PBS_O_WORKDIR=str(submit_dir), PBS_JOBID="4242.pbs-server", PBS_JOBNAME="rs-bench")
    proc = subprocess.run(
        ["bash", str(PBS_RECIPE)],
        cwd=home,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = submit_dir / "rs-bench-4242.json"
    assert f"wrote {result}" in proc.stdout
    check_document(json.loads(result.read_text()))

    env["CHECKPOINTS"] = "emtt"
    proc = subprocess.run(
        ["bash", str(PBS_RECIPE)],
        cwd=home,
        env={**env, "PBS_JOBID": "4243.pbs-server"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2 and "unknown checkpoint 'emtt'" in proc.stderr
    assert not (submit_dir / "rs-bench-4243.json").exists()
