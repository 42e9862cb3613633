"""Usage errors never pass, and never touch the manifest.

A mistyped env or checkpoint id on any command line exits 2 with close matches
(one rule, :func:`rootstock.install.envs.unknown_name`), and so does a numeric
option out of range: ``add --verify-timeout 0`` must not write ``failed`` over a
verified record. One real root per module: the sample EMT env, built by real uv
and verified on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ENVIRONMENTS, REPO, ROOTSTOCK, installed_root, run_rootstock
from tests.integration.checkpoint_envs import manifest_record

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def verified_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """EMT built, fetched and verified on the CPU; tests must leave it so."""
    path = tmp_path_factory.mktemp("names") / "root"
    root = installed_root(path, shared_uv_cache, [ENVIRONMENTS / "emt.py"])
    run_rootstock("add", "emt", "--device", "cpu", "--root", root, timeout=300)
    assert manifest_record(root, "emt", "emt")["state"] == "verified"
    return root


def refused(root: Path, *args: str) -> str:
    """Run a command that must be refused as a usage error; return its stderr."""
    manifest = root / "manifest.json"
    before = manifest.read_bytes()
    proc = run_rootstock(*args, "--root", root, check=False, timeout=120)
    assert proc.returncode == 2, (args, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "nothing to test" not in proc.stdout
    assert manifest.read_bytes() == before, f"{args} rewrote the manifest"
    assert manifest_record(root, "emt", "emt")["state"] == "verified"
    return proc.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("smoke-test", "--device", "cpu", "--env", "nosuch"), "unknown env 'nosuch'"),
        (("smoke-test", "--device", "cpu", "--env", "emtt"), "close matches: emt"),
        (("smoke-test", "--device", "cpu", "--checkpoint", "emtt"), "close matches: emt"),
        (
            ("smoke-test", "--device", "cpu", "--env", "emt", "--checkpoint", "emtt"),
            "unknown checkpoint 'emtt'",
        ),
        (("add", "emtt", "--device", "cpu"), "close matches: emt"),
        (("benchmark", "emtt", "--device", "cpu"), "close matches: emt"),
        (("serve", "emtt", "--socket", "unused.sock"), "close matches: emt"),
        (("install", "emtt", "--force"), "unknown env 'emtt'"),
        (("install", "emtt", "--force", "--dry-run"), "close matches: emt"),
    ],
    ids=lambda a: "-".join(a) if isinstance(a, tuple) else None,
)
def test_an_unknown_name_is_a_usage_error_with_close_matches(verified_root, args, expected):
    err = refused(verified_root, *args)
    assert expected in err, err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e308"])
def test_a_bad_verify_timeout_leaves_the_verified_record_alone(verified_root, value):
    err = refused(verified_root, "add", "emt", "--device", "cpu", "--verify-timeout", value)
    assert "Invalid value for '--verify-timeout'" in err
    err = refused(verified_root, "smoke-test", "--device", "cpu", "--verify-timeout", value)
    assert "Invalid value for '--verify-timeout'" in err


@pytest.mark.parametrize("args", [("--jobs", "0"), ("--jobs", "-2"), ("--push-every", "0")])
def test_bad_smoke_test_counts_run_nothing(verified_root, args):
    err = refused(verified_root, "smoke-test", "--device", "cpu", *args)
    assert f"Invalid value for '{args[0]}'" in err


def test_a_good_name_still_runs(verified_root):
    proc = run_rootstock(
        "smoke-test", "--device", "cpu", "--env", "emt", "--checkpoint", "emt", "--json",
        "--root", verified_root, timeout=300,
    )  # fmt: skip
    assert json.loads(proc.stdout)["counts"] == {"verified": 1}


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_an_id_a_sample_env_file_declares_names_that_file(verified_root, tmp_path, where):
    """``add mace-mp-0-small`` where only EMT is installed names the sample env file
    that declares the id, as a path that ``rootstock install`` takes from here."""
    cwd = REPO if where == "checkout" else tmp_path
    shown = "environments/mace.py" if where == "checkout" else str(ENVIRONMENTS / "mace.py")
    manifest = verified_root / "manifest.json"
    before = manifest.read_bytes()
    proc = subprocess.run(
        [*ROOTSTOCK, "add", "mace-mp-0-small", "--device", "cpu", "--root", str(verified_root)],
        cwd=cwd,
        env=os.environ.copy(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert (
        f"checkpoint 'mace-mp-0-small' is declared by {shown}, which is not installed in "
        f"{verified_root}" in proc.stderr
    ), proc.stderr
    assert f"rootstock install {shown}" in proc.stderr
    assert (cwd / shown).is_file()
    assert manifest.read_bytes() == before
