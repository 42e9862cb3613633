"""Real uv builds of the EMT env: fresh, rebuild from lock, upgrade, failed rebuild,
directory installs, lint refusals and concurrent installs.

The session's ``emt_root`` is shared and never modified; tests that rebuild use
their own ``scratch_root`` (same uv cache, so builds are warm).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from datetime import datetime
from pathlib import Path

import pytest

from rootstock.install.uv import uv_binary
from tests.conftest import ENVIRONMENTS, ROOTSTOCK, run_rootstock

pytestmark = pytest.mark.timeout(900)

TINY_ENV = textwrap.dedent('''\
    """A tiny EMT-backed env used by the install tests."""

    # /// script
    # requires-python = ">=3.11"
    # dependencies = [{deps}]
    # ///

    CHECKPOINTS = {checkpoints}


    def setup(checkpoint, device="cuda", **kw):
        from ase.calculators.emt import EMT

        return EMT()
    ''')


def tiny_env(directory: Path, name: str, ids: list[str], deps=('"ase>=3.23"', '"numpy"')) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(TINY_ENV.format(deps=", ".join(deps), checkpoints=repr({i: i for i in ids})))
    return path


def env_python(root: Path, name: str) -> Path:
    return root / "envs" / name / "bin" / "python"


def lock_versions(lock_text: str) -> dict[str, set[str]]:
    """Package -> every version the lock pins (forks by Python version pin several)."""
    versions: dict[str, set[str]] = {}
    for name, version in re.findall(r'(?m)^name = "([^"]+)"\nversion = "([^"]+)"', lock_text):
        versions.setdefault(name, set()).add(version)
    return versions


def test_fresh_build_layout(emt_root: Path):
    env_dir = emt_root / "envs" / "emt"
    assert env_dir.is_symlink(), "envs/<name> is swapped in atomically as a symlink"
    assert (env_dir / "env_source.py").read_text() == (ENVIRONMENTS / "emt.py").read_text()
    assert (emt_root / "environments" / "emt.py").read_text() == (
        ENVIRONMENTS / "emt.py"
    ).read_text()
    lock = (emt_root / "environments" / "emt.py.lock").read_text()
    assert (env_dir / "env_source.py.lock").read_text() == lock
    assert "ase" in lock_versions(lock)
    meta = json.loads((env_dir / "rootstock-env.json").read_text())
    assert meta["locked"] is True and meta["versions"]["ase"]
    assert meta["interpreter"]["world_usable"] is True
    assert not list((emt_root / ".build").iterdir()), "no build leftovers"
    wheels = list((emt_root / "wheels").glob("rootstock-*.whl"))
    assert len(wheels) == 1
    manifest = json.loads((emt_root / "manifest.json").read_text())
    assert manifest["envs"]["emt"]["source_hash"] == meta["source_hash"]


def test_env_holds_no_client_dependencies(emt_root: Path):
    """The wheel goes in --no-deps: uv, rich and click never enter a model env."""
    probe = (
        "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None "
        "for m in ['rootstock', 'ase', 'numpy', 'rich', 'click', 'uv']}))"
    )
    out = subprocess.run(
        [env_python(emt_root, "emt"), "-I", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    found = json.loads(out)
    assert found == {
        "rootstock": True,
        "ase": True,
        "numpy": True,
        "rich": False,
        "click": False,
        "uv": False,
    }


def test_env_metadata_records_the_uv_that_built_it(emt_root: Path):
    meta = json.loads((emt_root / "envs" / "emt" / "rootstock-env.json").read_text())
    direct = subprocess.run(
        [uv_binary(), "--version"], capture_output=True, text=True, check=True, timeout=60
    )
    assert meta["uv"] == direct.stdout.split()[1]


def test_env_ships_and_uses_bytecode(emt_root: Path):
    """Workers on a read-only filesystem cannot write bytecode: it must be there, valid."""
    proc = subprocess.run(
        [env_python(emt_root, "emt"), "-v", "-c", "import ase.calculators.emt, rootstock"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    log = proc.stderr
    assert proc.returncode == 0, log
    site = str(emt_root / "envs" / "emt")
    matched = [line for line in log.splitlines() if " matches " in line and site in line]
    assert any("/ase/__init__.py" in line for line in matched), log[-2000:]
    assert any("/rootstock/__init__.py" in line for line in matched), log[-2000:]
    stale = [
        line
        for line in log.splitlines()
        if ("bytecode is stale" in line or "could not" in line) and site in line
    ]
    assert not stale, stale[:5]


def test_rebuild_honours_lock_and_upgrade_reresolves(scratch_root: Path, tmp_path: Path):
    env_file = tiny_env(tmp_path / "src", "pinned", ["pinned-1"])
    constraint = tmp_path / "old-numpy.txt"
    constraint.write_text("numpy==2.2.6\n")
    run_rootstock("install", env_file, "--root", scratch_root, "--constraint", constraint)
    lock_file = scratch_root / "environments" / "pinned.py.lock"
    assert lock_versions(lock_file.read_text())["numpy"] == {"2.2.6"}
    first = os.path.realpath(scratch_root / "envs" / "pinned")

    # Without the constraint, a rebuild still reproduces the locked stack.
    run_rootstock("install", "pinned", "--force", "--root", scratch_root)
    assert lock_versions(lock_file.read_text())["numpy"] == {"2.2.6"}
    second = os.path.realpath(scratch_root / "envs" / "pinned")
    assert second != first and Path(first).is_dir(), "previous build kept for running workers"

    run_rootstock("install", "pinned", "--force", "--upgrade", "--root", scratch_root)
    upgraded = lock_versions(lock_file.read_text())["numpy"]
    assert "2.2.6" not in upgraded
    out = subprocess.run(
        [env_python(scratch_root, "pinned"), "-c", "import numpy; print(numpy.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out.strip() in upgraded
    assert not Path(first).exists(), "builds older than the previous one are pruned"


def test_failed_rebuild_keeps_old_env(scratch_root: Path, tmp_path: Path):
    good = tiny_env(tmp_path / "good", "keep", ["keep-1"])
    run_rootstock("install", good, "--root", scratch_root)
    before = os.path.realpath(scratch_root / "envs" / "keep")
    registered = (scratch_root / "environments" / "keep.py").read_text()

    bad = tiny_env(
        tmp_path / "bad",
        "keep",
        ["keep-1"],
        deps=('"ase"', '"rootstock-test-no-such-package-xq7==9.9"'),
    )
    proc = run_rootstock("install", bad, "--force", "--root", scratch_root, check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert os.path.realpath(scratch_root / "envs" / "keep") == before
    assert (scratch_root / "environments" / "keep.py").read_text() == registered
    assert not list((scratch_root / ".build").iterdir())
    subprocess.run([env_python(scratch_root, "keep"), "-c", "import ase"], check=True, timeout=60)
    # Nothing half-registered: the same install simply retries (and fails the same way).
    again = run_rootstock("install", bad, "--force", "--root", scratch_root, check=False)
    assert again.returncode == 1


def test_failed_first_build_registers_nothing(scratch_root: Path, tmp_path: Path):
    bad = tiny_env(tmp_path, "never", ["never-1"], deps=('"rootstock-test-no-such-pkg-q2"',))
    proc = run_rootstock("install", bad, "--root", scratch_root, check=False)
    assert proc.returncode == 1
    assert not (scratch_root / "envs" / "never").exists()
    assert not (scratch_root / "environments" / "never.py").exists()


def test_directory_install(scratch_root: Path, tmp_path: Path):
    src = tmp_path / "envdir"
    tiny_env(src, "alpha", ["alpha-1"])
    tiny_env(src, "beta", ["beta-1", "beta-2"])
    (src / "notes.txt").write_text("not an env file")
    proc = run_rootstock("install", src, "--root", scratch_root, "--json")
    outcomes = json.loads(proc.stdout)
    assert [(o["name"], o["status"]) for o in outcomes] == [("alpha", "built"), ("beta", "built")]
    listing = json.loads(run_rootstock("list", "--root", scratch_root, "--json").stdout)
    assert {e["name"]: e["checkpoints"] for e in listing["envs"]} == {
        "alpha": ["alpha-1"],
        "beta": ["beta-1", "beta-2"],
    }
    # Installing the same directory again changes nothing.
    again = json.loads(run_rootstock("install", src, "--root", scratch_root, "--json").stdout)
    assert {o["status"] for o in again} == {"unchanged"}


def test_lint_failure_builds_nothing(scratch_root: Path, tmp_path: Path):
    bad = tmp_path / "broken.py"
    bad.write_text("# /// script\n# dependencies = ['ase']\n# ///\nCHECKPOINTS = {'x': 1}\n")
    proc = run_rootstock("install", bad, "--root", scratch_root, check=False)
    assert proc.returncode == 1
    assert f"{bad}:" in proc.stderr and "fix:" in proc.stderr
    assert not (scratch_root / "envs" / "broken").exists()
    assert not (scratch_root / "environments" / "broken.py").exists()


def test_duplicate_id_across_envs_is_refused(scratch_root: Path, tmp_path: Path):
    run_rootstock(
        "install", tiny_env(tmp_path / "a", "first", ["shared-id"]), "--root", scratch_root
    )
    proc = run_rootstock(
        "install",
        tiny_env(tmp_path / "b", "second", ["shared-id"]),
        "--root",
        scratch_root,
        check=False,
    )
    assert proc.returncode == 1
    assert "'shared-id'" in proc.stderr and "already declared" in proc.stderr


def _start_install(env_file: Path, root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*ROOTSTOCK, "install", str(env_file), "--root", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    results = []
    try:
        for proc in procs:
            _out, err = proc.communicate(timeout=600)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    return results


def test_concurrent_installs_of_two_envs(scratch_root: Path, tmp_path: Path):
    procs = [
        _start_install(tiny_env(tmp_path, n, [f"{n}-1"]), scratch_root) for n in ("left", "right")
    ]
    results = _finish(procs)
    assert [rc for rc, _ in results] == [0, 0], results
    names = json.loads(run_rootstock("list", "--root", scratch_root, "--json").stdout)
    assert sorted(e["name"] for e in names["envs"]) == ["left", "right"]
    manifest = json.loads((scratch_root / "manifest.json").read_text())
    assert {"left", "right"} <= set(manifest["envs"])


def test_concurrent_installs_cannot_both_claim_an_id(scratch_root: Path, tmp_path: Path):
    procs = [
        _start_install(tiny_env(tmp_path / n, n, ["contested"]), scratch_root)
        for n in ("one", "two")
    ]
    results = _finish(procs)
    assert sorted(rc for rc, _ in results) == [0, 1], results
    loser = next(err for rc, err in results if rc == 1)
    assert "already declared" in loser
    listing = json.loads(run_rootstock("list", "--root", scratch_root, "--json").stdout)
    assert [e["checkpoints"] for e in listing["envs"]] == [["contested"]]


def test_install_rejects_unknown_name(scratch_root: Path):
    proc = run_rootstock("install", "nosuchenv", "--force", "--root", scratch_root, check=False)
    assert proc.returncode == 2  # a name typed on the command line: a usage error
    assert "unknown env 'nosuchenv'" in proc.stderr
    missing = run_rootstock("install", "nosuchenv.py", "--root", scratch_root, check=False)
    assert missing.returncode == 1
    assert "env file nosuchenv.py does not exist" in missing.stderr


STATUS_KEYS = {"root", "cache_root", "clusters", "envs", "warnings"}
ENV_ROW_KEYS = {
    "name",
    "state",
    "error",
    "python",
    "torch",
    "built_at",
    "interpreter",
    "clusters",
    "hotfixed",
    "checkpoints",
}


def test_status_json_shape(emt_root: Path):
    doc = json.loads(run_rootstock("status", "--root", emt_root, "--json", "--sizes").stdout)
    # docs/cli.md: the five keys, plus the cache sizes that --sizes adds
    assert set(doc) == STATUS_KEYS | {"cache_size_bytes"}
    assert doc["root"] == str(emt_root)
    assert doc["cache_root"] == str(emt_root)  # make_root declares no separate cache
    assert doc["warnings"] == []
    sizes = doc["cache_size_bytes"]
    assert set(sizes) == {"cache", "home"}
    assert all(type(sizes[k]) is int and sizes[k] >= 0 for k in sizes), sizes
    assert doc["clusters"] == ["testbox"]
    for row in doc["envs"]:
        assert set(row) == ENV_ROW_KEYS | {"size_bytes"}, row["name"]
        assert isinstance(row["name"], str) and isinstance(row["state"], str)
        assert type(row["hotfixed"]) is bool
        assert isinstance(row["checkpoints"], list)
        for key in ("error", "python", "torch", "built_at", "interpreter"):
            assert row[key] is None or isinstance(row[key], str), (row["name"], key)
        assert row["clusters"] is None or all(isinstance(c, str) for c in row["clusters"])
    (env,) = [e for e in doc["envs"] if e["name"] == "emt"]
    assert env["state"] == "built" and env["python"] and env["size_bytes"] > 1_000_000
    assert re.fullmatch(r"\d+\.\d+\.\d+", env["python"]), env["python"]
    assert (env["error"], env["hotfixed"]) == (None, False)
    assert Path(env["interpreter"]).is_absolute()
    assert datetime.fromisoformat(env["built_at"]).tzinfo is not None
    assert env["checkpoints"] == [
        {
            "id": "emt",
            "states": {
                "testbox": {
                    "state": "not fetched",
                    "cluster": "testbox",
                    "device_kind": None,
                    "device": None,
                    "at": None,
                    "age_s": None,
                    "fetched_at": None,
                    "message": None,
                    "recorded_state": None,
                    "checks": None,
                }
            },
        }
    ]
