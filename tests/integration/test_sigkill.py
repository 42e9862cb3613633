"""SIGKILL ``add``, ``smoke-test --jobs 2`` and ``install --force`` at random moments.

Each command is a real ``python -m rootstock.cli.main`` subprocess on a private root
with real uv-built EMT envs, killed 6 times in CI (``ROOTSTOCK_SIGKILL_TRIALS``
overrides it; ``scripts/soak`` runs 20 or more) at moments drawn with a fixed seed
(``ROOTSTOCK_SIGKILL_SEED``). The campaign and its checks are in
:mod:`tests.integration.kill_campaign`: no process of a killed command is alive 5 s
after the kill; the manifest parses and ``status --json`` exits 0; the next run of the
same command, left to finish, removes every run dir the killed runs left in their
(private) ``$TMPDIR`` and every staging entry under ``{root}/.build/`` or stray build
under ``{root}/envs/``, and leaves none of its own (nor any process).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import ENVIRONMENTS, installed_root, run_rootstock
from tests.integration.checkpoint_envs import write_env
from tests.integration.kill_campaign import campaign_timeout_s, kill_campaign, run_tmpdir
from tests.integration.killing import run_trial

pytestmark = pytest.mark.timeout(campaign_timeout_s())

__all__ = ["run_tmpdir"]  # a fixture: imported so that pytest finds it here


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """A private root: the sample EMT env plus a two-checkpoint twin, all three verified.

    Private because ``install --force`` trials rebuild its env; three fetched
    checkpoints give ``smoke-test --jobs 2`` two workers at once and a third to queue.
    """
    base = tmp_path_factory.mktemp("sigkill")
    twin = write_env(base / "env-files", "twin", ["twin-a", "twin-b"])
    root = installed_root(base / "root", shared_uv_cache, [ENVIRONMENTS / "emt.py", twin])
    for checkpoint in ("emt", "twin-a", "twin-b"):
        run_rootstock("add", checkpoint, "--root", root, "--device", "cpu", "--no-push")
    return root


def test_sigkill_add(kill_root: Path, run_tmpdir: Path, tmp_path: Path):
    """``add emt`` killed mid-fetch, mid-spawn or mid-verification leaves nothing behind."""
    args = ["add", "emt", "--root", str(kill_root), "--device", "cpu", "--no-push"]
    kill_campaign("add", args, kill_root, run_tmpdir, tmp_path)


def test_sigkill_smoke_test_jobs_2(kill_root: Path, run_tmpdir: Path, tmp_path: Path):
    """``smoke-test --jobs 2``, whose workers are spawned from pool threads."""
    args = ["smoke-test", "--root", str(kill_root), "--device", "cpu", "--jobs", "2", "--no-push"]
    kill_campaign("smoke-test", args, kill_root, run_tmpdir, tmp_path)


def test_sigkill_install_force(kill_root: Path, run_tmpdir: Path, tmp_path: Path):
    """``install emt --force``: uv's children die with it; the next install sweeps staging."""
    args = ["install", "emt", "--force", "--root", str(kill_root), "--no-push"]
    kill_campaign("install --force", args, kill_root, run_tmpdir, tmp_path)


def test_harness_sees_a_descendant_that_escaped_to_its_own_session(tmp_path: Path):
    """The harness itself: an orphan in a new session is still reported, then killed."""
    # The shell starts a sleeper in its own session (setsid) and is killed while the
    # sleeper runs on, re-parented: exactly what a leaked uv child or worker does.
    script = "setsid sleep 60 & echo started; wait"
    trial = run_trial(
        ["sh", "-c", script], dict(os.environ), tmp_path / "escape", kill_after=1.0, grace=0.5,
        timeout=30,
    )  # fmt: skip
    assert trial.killed and trial.returncode == -9
    assert [p.get("comm") for p in trial.survivors] == ["sleep"]
    assert trial.survivors[0]["sid"] != os.getsid(0)
    assert trial.unkillable == []
    clean = run_trial(["true"], dict(os.environ), tmp_path / "clean", kill_after=None, grace=0.5)
    assert clean.returncode == 0 and not clean.killed and clean.survivors == []
