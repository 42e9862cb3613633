"""The wheel that ``uv build`` makes is the whole product, used with no checkout beside it.

The wheel (with the ``[dashboard]`` extra) goes into a clean venv, and everything then
runs from a temporary directory with no ``src/`` in reach: ``--version``, ``init``,
``install`` of the sample EMT env shipped inside the wheel, ``add emt``, a
``RootstockCalculator`` compared with EMT in-process, the worker inside the built env,
and ``dashboard serve``, whose migrations and templates must come from the wheel; an id
that another shipped sample env declares names the wheel's copy of that file.
The venv's packages come from the user's uv cache (offline, as ``scripts/dev/bootstrap``
filled it), falling back to the index; the env build uses the run's shared uv cache.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.checkpoint_envs import manifest_record
from tests.integration.conftest import process_group

pytestmark = pytest.mark.timeout(600)

CALCULATOR_SCRIPT = """
import json, sys
import numpy as np
from ase.build import bulk
from ase.calculators.emt import EMT
import rootstock
from rootstock import RootstockCalculator

atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 1, 1)
atoms.rattle(0.05, seed=3)
ref = atoms.copy()
ref.calc = EMT()
with RootstockCalculator(root=sys.argv[1], checkpoint="emt", device="cpu") as calc:
    atoms.calc = calc
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    with open(f"/proc/{calc.worker_pid}/cmdline", "rb") as fh:
        worker_argv = [a.decode() for a in fh.read().split(b"\\0") if a]
print(json.dumps({
    "energy_error": abs(energy - ref.get_potential_energy()),
    "force_error": float(np.abs(forces - ref.get_forces()).max()),
    "worker_argv": worker_argv,
    "client": rootstock.__file__,
}))
"""


def uv_bin() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def run(argv: list, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``argv`` with a deadline; fail with its output if it fails."""
    proc = subprocess.run(
        [str(a) for a in argv],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def uv_offline_first(argv: list, env: dict, cwd: Path) -> None:
    """A uv command offline (the cache has what it needs), else once more online."""
    offline = subprocess.run(
        [*map(str, argv), "--offline"],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=300,
    )
    if offline.returncode != 0:
        run(argv, env, cwd)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory, user_uv_cache: Path) -> dict:
    """The wheel built from this tree, installed with ``[dashboard]`` into a clean venv;
    the paths and the environment in which its commands run."""
    base = tmp_path_factory.mktemp("wheel")
    work = base / "work"  # the commands' working directory: no checkout in reach
    work.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ROOTSTOCK_ROOT")
    }
    env.update(UV_CACHE_DIR=str(user_uv_cache), ROOTSTOCK_CONFIG=str(base / "config.toml"))
    uv = uv_bin()
    started = time.monotonic()
    uv_offline_first([uv, "build", "--quiet", "--out-dir", base / "dist", REPO], env, work)
    wheels = list((base / "dist").glob("rootstock-*-py3-none-any.whl"))
    assert len(wheels) == 1 and list((base / "dist").glob("rootstock-*.tar.gz")), wheels
    venv = base / "venv"
    run([uv, "venv", "--quiet", "--python", sys.executable, venv], env, work)
    python = venv / "bin" / "python"
    uv_offline_first(
        [uv, "pip", "install", "--quiet", "--python", python, f"{wheels[0]}[dashboard]"], env, work
    )
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    print(f"wheel built and installed in {time.monotonic() - started:.1f} s")
    return {"wheel": wheels[0], "venv": venv, "python": python, "env": env, "work": work}


def test_the_wheel_holds_what_the_runtime_reads(wheel_venv):
    names = set(zipfile.ZipFile(wheel_venv["wheel"]).namelist())
    for needed in (
        "rootstock/worker/__main__.py",
        "rootstock/dashboard/migrations/env.py",
        "rootstock/dashboard/migrations/script.py.mako",
        "rootstock/dashboard/templates/base.html",
        "rootstock/sample_envs/emt.py",
        "rootstock/sample_envs/mace.py",
        "rootstock/install/clusters.toml",
    ):
        assert needed in names, needed
    shipped = {n for n in names if n.startswith("rootstock/dashboard/migrations/versions/")}
    assert shipped == {
        f"rootstock/{p.relative_to(REPO / 'src' / 'rootstock').as_posix()}"
        for p in (REPO / "src/rootstock/dashboard/migrations/versions").glob("*.py")
    }


def test_the_installed_wheel_builds_and_runs_emt_with_no_checkout(wheel_venv, shared_uv_cache):
    env, work, python = wheel_venv["env"], wheel_venv["work"], wheel_venv["python"]
    site = run(
        [python, "-c", "import rootstock, sysconfig; print(rootstock.__file__); "
         "print(sysconfig.get_paths()['purelib'])"],
        env, work,
    ).stdout.split()  # fmt: skip
    assert Path(site[0]).is_relative_to(site[1]), site  # the venv's copy, not src/
    version = run(["rootstock", "--version"], env, work).stdout
    assert "0.1.0" in version, version
    samples = run(
        [python, "-c", "from rootstock.install.samples import sample_envs_dir as d; print(d())"],
        env,
        work,
    ).stdout.strip()
    sample_emt = Path(samples) / "emt.py"
    assert sample_emt.is_relative_to(site[1]) and sample_emt.is_file(), samples
    # The built-in cluster registry is read from the wheel's data file.
    registry = run(
        [python, "-c", "from rootstock.install.clusters import load_registry as r; print(*r())"],
        env,
        work,
    ).stdout.split()
    assert {"della", "perlmutter"} <= set(registry), registry

    root = work / "root"
    run(["rootstock", "init", "--root", root, "--cluster", "wheelbox", "--yes"], env, work)
    (root / ".uv-cache").symlink_to(shared_uv_cache)  # as make_root does: the run's cache
    run(["rootstock", "install", sample_emt, "--root", root, "--no-push"], env, work, 600)
    run(["rootstock", "add", "emt", "--device", "cpu", "--root", root, "--no-push"], env, work)
    assert manifest_record(root, "emt", "emt", cluster="wheelbox")["state"] == "verified"
    # An id that a shipped sample env declares names the wheel's copy of that file.
    refused = subprocess.run(
        ["rootstock", "add", "mace-mp-0-small", "--device", "cpu", "--root", str(root)],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stderr
    assert f"rootstock install {Path(samples) / 'mace.py'}" in refused.stderr, refused.stderr

    result = json.loads(run([python, "-c", CALCULATOR_SCRIPT, root], env, work).stdout)
    assert result["energy_error"] < 1e-10 and result["force_error"] < 1e-10, result
    assert Path(result["client"]).is_relative_to(site[1]), result
    # The worker runs the built env's own interpreter, with the wheel's vendored worker.
    assert result["worker_argv"][0].startswith(str(root / "envs" / "emt")), result
    worker = run(
        [root / "envs" / "emt" / "bin" / "python", "-c",
         "import rootstock.worker.main as m; print(m.__file__)"],
        env, work,
    ).stdout.strip()  # fmt: skip
    assert Path(worker).resolve().is_relative_to((root / "envs").resolve()), worker


def test_the_installed_wheel_serves_the_dashboard(wheel_venv):
    env, work = wheel_venv["env"], wheel_venv["work"]
    db = work / "dashboard.sqlite3"
    log = work / "serve.log"
    argv = ["rootstock", "dashboard", "serve", "--db", str(db), "--port", "0"]
    with open(log, "w") as out, process_group(argv, env=env, cwd=work, stdout=out, stderr=out):
        deadline = time.monotonic() + 90
        while not (found := re.search(r"dashboard: (http://\S+)", log.read_text())):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with direct.open(found.group(1), timeout=30) as response:
            assert response.status == 200
            page = response.read().decode()
    assert "<html" in page.lower(), page[:500]
    shipped = [
        n.rsplit("/", 1)[1].split("_", 1)[0]
        for n in zipfile.ZipFile(wheel_venv["wheel"]).namelist()
        if re.fullmatch(r"rootstock/dashboard/migrations/versions/\d+_\w+\.py", n)
    ]
    with sqlite3.connect(db) as conn:
        (head,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    assert head == max(shipped)
