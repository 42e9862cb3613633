"""SIGKILL ``add``, ``smoke-test --jobs 2`` and ``install --force`` at random moments.

Each command is a real ``python -m rootstock.cli.main`` subprocess on a private root
with real uv-built EMT envs. Its normal duration is measured once, then it is killed
(SIGKILL to its own process only, as ``kill -9`` or the OOM killer would) at
``TRIALS`` moments drawn uniformly from (0, duration) with a fixed seed. Each trial
runs under :mod:`tests.integration.killing`, a child-subreaper harness that sees every
process the command left behind, whatever session it moved to. Afterwards:

* no process of a killed command is alive ``GRACE_S`` (5 s) after the kill;
* the manifest parses (``json.loads`` and the project's loader) and
  ``status --json`` exits 0;
* the next run of the same command, left to finish, removes every run dir the
  killed runs left in their (private) ``$TMPDIR`` and every staging entry under
  ``{root}/.build/`` or stray build under ``{root}/envs/``, and leaves none of its
  own (nor any process).

All problems of one command are collected and reported together, with the seed
(``ROOTSTOCK_SIGKILL_SEED`` overrides it; ``ROOTSTOCK_SIGKILL_TRIALS`` the count).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from rootstock.install.layout import resolve_layout
from rootstock.install.manifest.store import load_manifest
from tests.conftest import ENVIRONMENTS, ROOTSTOCK, copy_env, make_root, run_rootstock
from tests.integration.checkpoint_envs import write_env
from tests.integration.killing import TrialResult, run_trial

pytestmark = pytest.mark.timeout(900)

TRIALS = int(os.environ.get("ROOTSTOCK_SIGKILL_TRIALS", "20"))
SEED = int(os.environ.get("ROOTSTOCK_SIGKILL_SEED", "1212"))
GRACE_S = 5.0
COMMAND_TIMEOUT_S = 240.0
RUN_DIR_PREFIX = "rootstock-"


@pytest.fixture(scope="module")
def kill_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """A private root: the sample EMT env plus a two-checkpoint twin, all three verified.

    Private because ``install --force`` trials rebuild its env; three fetched
    checkpoints give ``smoke-test --jobs 2`` two workers at once and a third to queue.
    """
    base = tmp_path_factory.mktemp("sigkill")
    root = make_root(base / "root", shared_uv_cache)
    sources = base / "env-files"
    copy_env(ENVIRONMENTS / "emt.py", sources)
    write_env(sources, "twin", ["twin-a", "twin-b"])
    run_rootstock("install", sources, "--root", root, "--no-push", timeout=900)
    for checkpoint in ("emt", "twin-a", "twin-b"):
        run_rootstock("add", checkpoint, "--root", root, "--device", "cpu", "--no-push")
    return root


@pytest.fixture
def run_tmpdir():
    """A private, short $TMPDIR for the command: its run dirs can be counted there.

    Short, because a run dir's socket path must fit in sun_path; a longer base
    makes the runtime fall back to /tmp, where this test could not see it.
    """
    path = Path(tempfile.mkdtemp(prefix="rs-kill-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def command_env(tmpdir: Path) -> dict[str, str]:
    """The command's environment: the session's, with a private temp dir."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONFAULTHANDLER": "1"}
    # $XDG_RUNTIME_DIR would win over $TMPDIR as the run-dir base.
    env.pop("XDG_RUNTIME_DIR", None)
    return env


def live_targets(root: Path) -> set[str]:
    """The build directories the ``envs/<name>`` links point at now."""
    envs = root / "envs"
    return {os.readlink(p) for p in envs.iterdir() if p.is_symlink() and not p.name.startswith(".")}


def leftovers(root: Path, tmpdir: Path) -> set[str]:
    """Run dirs in ``tmpdir``, entries of ``{root}/.build/``, hidden entries of ``envs/``."""
    found = {f"$TMPDIR/{p.name}" for p in tmpdir.iterdir() if p.name.startswith(RUN_DIR_PREFIX)}
    build = root / ".build"
    if build.is_dir():
        found |= {f".build/{p.name}" for p in build.iterdir()}
    found |= {f"envs/{p.name}" for p in (root / "envs").iterdir() if p.name.startswith(".")}
    return found


def describe_trial(index: int, trial: TrialResult) -> str:
    """One failed trial, with its survivors and the end of the command's output."""
    what = f"killed at {trial.kill_after:.2f} s" if trial.killed else "finished before the kill"
    lines = [f"trial {index} ({what}): {len(trial.survivors)} process(es) alive {GRACE_S} s later"]
    for proc in trial.survivors:
        lines.append(
            f"    pid {proc.get('pid')} ppid {proc.get('ppid')} sid {proc.get('sid')} "
            f"{proc.get('comm')}: {proc.get('cmdline', '')[:300]}"
        )
    if trial.unkillable:
        lines.append(f"    would not die: {trial.unkillable}")
    return "\n".join(lines)


def kill_campaign(name: str, args: list[str], root: Path, tmpdir: Path, logs: Path) -> None:
    """Measure, kill ``TRIALS`` times, check the aftermath; fail once with every problem."""
    argv = [*ROOTSTOCK, *args]
    env = command_env(tmpdir)
    run = 0

    def trial(kill_after: float | None) -> TrialResult:
        nonlocal run
        run += 1
        return run_trial(
            argv, env, logs / f"{name}-{run}", kill_after=kill_after, grace=GRACE_S,
            timeout=COMMAND_TIMEOUT_S,
        )  # fmt: skip

    baseline = trial(None)
    assert baseline.returncode == 0, f"{name} failed un-killed:\n{baseline.output_tail()}"
    duration = baseline.elapsed
    rng = random.Random(f"{SEED}:{name}")
    moments = [rng.uniform(0.0, duration) for _ in range(TRIALS)]

    problems: list[str] = []
    trials = [trial(moment) for moment in moments]
    left_alive = [(i, t) for i, t in enumerate(trials) if t.survivors or t.unkillable]
    problems += [describe_trial(i, t) for i, t in left_alive]

    try:
        json.loads((root / "manifest.json").read_text())
        load_manifest(resolve_layout(root))
    except Exception as exc:  # any failure to parse is the finding itself
        problems.append(f"the manifest does not parse: {type(exc).__name__}: {exc}")
    status = run_rootstock("status", "--json", "--root", root, check=False, timeout=60)
    if status.returncode != 0:
        problems.append(f"status --json exited {status.returncode}:\n{status.stderr[-1500:]}")
    else:
        try:
            json.loads(status.stdout)
        except json.JSONDecodeError as exc:
            problems.append(f"status --json printed no JSON: {exc}")

    allowed = live_targets(root)
    before = {e for e in leftovers(root, tmpdir) if e.split("/")[1] not in allowed}
    after_run = trial(None)
    if after_run.returncode != 0:
        problems.append(f"the next {name} failed:\n{after_run.output_tail()}")
    if after_run.survivors:
        problems.append(describe_trial(len(trials), after_run).replace("trial", "next run", 1))
    allowed |= live_targets(root)
    after = {e for e in leftovers(root, tmpdir) if e.split("/")[1] not in allowed}
    if before & after:
        problems.append(
            f"left by killed runs, still there after the next {name}: {sorted(before & after)}"
        )
    # A sweep may rename what it claims before deleting it, and a run that finished
    # must not leave its own behind either: nothing new may remain.
    if after - before:
        problems.append(f"left after the next {name} finished: {sorted(after - before)}")

    killed = sum(t.killed for t in trials)
    summary = (
        f"{name}: seed {SEED}, {TRIALS} kills in (0, {duration:.2f} s), {killed} landed "
        f"before it finished; {len(left_alive)} left processes alive {GRACE_S} s later; "
        f"{len(before)} leftover(s) before the next run"
    )
    print(summary)  # shown with -s or -rA, even when the campaign passes
    if problems:
        pytest.fail(summary + "\n" + "\n".join(problems), pytrace=False)


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
