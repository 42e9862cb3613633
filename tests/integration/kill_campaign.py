"""A SIGKILL campaign: kill one command at random moments, then check the install.

Used by ``test_sigkill.py`` (``add``, ``smoke-test``, ``install --force``) and
``test_sigkill_sync_prune.py`` (``sync``, ``prune``). The command is a real
``python -m rootstock.cli.main`` subprocess on a private root. Its normal duration
is measured once, then it is killed (SIGKILL to its own process only, as ``kill -9``
or the OOM killer would) at ``CI_TRIALS`` (6) moments drawn uniformly from
(0, duration) with a fixed seed; ``scripts/soak`` runs the same campaigns with 20 or
more. Each trial runs under :mod:`tests.integration.killing`, a child-subreaper
harness that sees every process the command left behind, whatever session it moved
to. Afterwards:

* no process of a killed command is alive ``GRACE_S`` (5 s) after the kill;
* the manifest parses (``json.loads`` and the project's loader) and
  ``status --json`` exits 0;
* optionally, ``check-perms --json`` reports no problem it did not report before
  the campaign;
* the next run of the same command, left to finish, exits 0, removes every run dir
  the killed runs left in their (private) ``$TMPDIR``, every staging entry under
  ``{root}/.build/``, every stray build under ``{root}/envs/``, every ``.trash/``
  entry and any prune journal, and leaves none of its own (nor any process);
* whatever extra checks the caller passes.

A command whose every run must find work (``sync``, ``prune``: one that converges
has nothing left to kill) passes ``prepare``, which re-creates the work before the
measuring run and before each trial, but not before the next run: that is the
maintainer re-running the same command after the kill. One whose short phases come
after a long one passes ``late_mark``, so that part of the kills land in them.

All problems of one campaign are collected and reported together, with the seed
and the count (``ROOTSTOCK_SIGKILL_SEED`` and ``ROOTSTOCK_SIGKILL_TRIALS`` replay
them).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rootstock.install.machine import resolve_layout
from rootstock.install.manifest.store import load_manifest
from tests.conftest import ROOTSTOCK, run_rootstock
from tests.integration.killing import TrialResult, run_trial

SEED = int(os.environ.get("ROOTSTOCK_SIGKILL_SEED", "1212"))
GRACE_S = 5.0
COMMAND_TIMEOUT_S = 240.0
RUN_DIR_PREFIX = "rootstock-"


#: Kills per campaign in a CI run: enough to land in each phase (a campaign with a
#: ``late_mark`` draws half of them after it). ``scripts/soak`` runs 20 or more.
CI_TRIALS = 6


def trials_from_env(default: int = CI_TRIALS) -> int:
    """``ROOTSTOCK_SIGKILL_TRIALS`` if set, else ``default``."""
    return int(os.environ.get("ROOTSTOCK_SIGKILL_TRIALS", str(default)))


def campaign_timeout_s(campaigns: int = 1) -> float:
    """A test's deadline for ``campaigns`` campaigns of ``trials_from_env()`` kills
    (as ``pytest.mark.timeout``): generous per trial, so that a soak fits too."""
    return 300.0 + campaigns * 60.0 * trials_from_env()


@pytest.fixture
def run_tmpdir() -> Iterator[Path]:
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
    """Run dirs in ``tmpdir``; entries of ``.build/``, ``.trash/``; hidden entries of ``envs/``.

    Plus ``.prune-journal.json``: a journal is a deletion still owed.
    """
    found = {f"$TMPDIR/{p.name}" for p in tmpdir.iterdir() if p.name.startswith(RUN_DIR_PREFIX)}
    for area in (".build", ".trash"):
        if (root / area).is_dir():
            found |= {f"{area}/{p.name}" for p in (root / area).iterdir()}
    found |= {f"envs/{p.name}" for p in (root / "envs").iterdir() if p.name.startswith(".")}
    if (root / ".prune-journal.json").exists():
        found.add("./.prune-journal.json")
    return found


def perm_problems(root: Path) -> tuple[set[tuple[str, str]], str | None]:
    """``check-perms --json``'s problems as (kind, path) pairs, or an error message."""
    proc = run_rootstock("check-perms", root, "--json", check=False, timeout=120)
    if proc.returncode not in (0, 1):
        return set(), f"check-perms exited {proc.returncode}:\n{proc.stderr[-1500:]}"
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        return set(), f"check-perms --json printed no JSON: {exc}"
    return {(p["kind"], p["path"]) for p in report["problems"]}, None


def describe_trial(index: int, trial: TrialResult) -> str:
    """One failed trial, with its survivors and the end of the command's output."""
    at = (trial.kill_after or 0.0) + (trial.mark_at or 0.0)
    what = f"killed at {at:.2f} s" if trial.killed else "finished before the kill"
    lines = [f"trial {index} ({what}): {len(trial.survivors)} process(es) alive {GRACE_S} s later"]
    for proc in trial.survivors:
        lines.append(
            f"    pid {proc.get('pid')} ppid {proc.get('ppid')} sid {proc.get('sid')} "
            f"{proc.get('comm')}: {proc.get('cmdline', '')[:300]}"
        )
    if trial.unkillable:
        lines.append(f"    would not die: {trial.unkillable}")
    return "\n".join(lines)


def valid_install(root: Path) -> list[str]:
    """What is wrong with ``root`` as an install: its manifest, ``status --json``."""
    problems: list[str] = []
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
    return problems


@dataclass
class Campaign:
    """One command's campaign and the checks beyond the common ones.

    ``prepare(i)`` re-creates the command's work before run ``i`` (0 is the
    measuring run, then one per trial); ``after_next()`` returns extra problems
    found after the next run; ``stays(entry)`` says which leftover entries (as
    :func:`leftovers` names them) may outlive the next run; ``perms`` compares
    ``check-perms`` with a baseline taken before the first run.

    Uniform moments rarely hit a short phase after a long one (a sync's downloads
    after its build, a prune's deletions after its start-up). With ``late_mark`` (a
    piece of an output line), the measuring run records when that line appears,
    and ``late_share`` of the kills are drawn from that moment to the end instead.
    """

    name: str
    args: list[str]
    root: Path
    tmpdir: Path
    logs: Path
    trials: int = field(default_factory=trials_from_env)
    prepare: Callable[[int], None] | None = None
    after_next: Callable[[], list[str]] | None = None
    stays: Callable[[str], bool] | None = None
    perms: bool = False
    late_mark: str | None = None
    late_share: float = 0.5


def timed_run(argv: list[str], env: dict[str, str], mark: str) -> tuple[float, float]:
    """Run ``argv`` to the end; return (its duration, when a line holding ``mark`` appeared).

    Its output is read line by line as it comes (stderr merged into stdout), in a
    session of its own that is killed, group and all, if it overruns.
    """
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    seen: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if mark in line and not seen:
                seen.append(time.monotonic() - start)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=COMMAND_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    duration = time.monotonic() - start
    reader.join(timeout=30)
    output = "".join(lines)[-3000:]
    assert code == 0, f"{argv[3:5]} failed un-killed ({code}):\n{output}"
    assert seen, f"no line holding {mark!r} in the un-killed run:\n{output}"
    return duration, seen[0]


def run_campaign(campaign: Campaign) -> str:
    """Measure, kill ``campaign.trials`` times, check the aftermath; fail once with every problem.

    Returns the one-line summary (also printed, so ``-s`` or ``-rA`` shows it).
    """
    c = campaign
    argv = [*ROOTSTOCK, *c.args]
    env = command_env(c.tmpdir)
    run = 0
    started = time.monotonic()

    def trial(kill_after: float | None, after_mark: str | None = None) -> TrialResult:
        nonlocal run
        run += 1
        return run_trial(
            argv, env, c.logs / f"{c.name.replace(' ', '_')}-{run}", kill_after=kill_after,
            grace=GRACE_S, timeout=COMMAND_TIMEOUT_S, after_mark=after_mark,
        )  # fmt: skip

    problems: list[str] = []
    perms_before: set[tuple[str, str]] = set()
    if c.perms:
        perms_before, error = perm_problems(c.root)
        assert error is None, error

    if c.prepare is not None:
        c.prepare(0)
    rng = random.Random(f"{SEED}:{c.name}")
    window = ""
    if c.late_mark is None:
        baseline = trial(None)
        assert baseline.returncode == 0, f"{c.name} failed un-killed:\n{baseline.output_tail()}"
        duration = baseline.elapsed
        moments = [rng.uniform(0.0, duration) for _ in range(c.trials)]
    else:
        duration, mark = timed_run(argv, env, c.late_mark)
        late = round(c.trials * c.late_share)
        # (seconds, counted from the mark?): late ones count from the mark's line.
        draws = [(rng.uniform(0.0, duration), False) for _ in range(c.trials - late)]
        draws += [(rng.uniform(0.0, duration - mark), True) for _ in range(late)]
        rng.shuffle(draws)
        window = f" ({late} of them counted from {c.late_mark!r}, seen at {mark:.2f} s)"

    if c.late_mark is None:
        draws = [(moment, False) for moment in moments]
    trials = []
    for index, (moment, from_mark) in enumerate(draws, 1):
        if c.prepare is not None:
            c.prepare(index)
        trials.append(trial(moment, c.late_mark if from_mark else None))
    left_alive = [(i, t) for i, t in enumerate(trials) if t.survivors or t.unkillable]
    problems += [describe_trial(i, t) for i, t in left_alive]

    problems += valid_install(c.root)
    if c.perms:
        perms_after, error = perm_problems(c.root)
        if error is not None:
            problems.append(error)
        elif perms_after - perms_before:
            problems.append(
                "check-perms finds problems it did not find before the campaign: "
                f"{sorted(perms_after - perms_before)}"
            )

    # A generation live before the next run may stay as its kept predecessor.
    allowed: set[str] = set()

    def lingering() -> set[str]:
        allowed.update(live_targets(c.root))
        return {
            e
            for e in leftovers(c.root, c.tmpdir)
            if e.split("/")[1] not in allowed and not (c.stays and c.stays(e))
        }

    before = lingering()
    after_run = trial(None)
    if after_run.returncode != 0:
        problems.append(f"the next {c.name} failed:\n{after_run.output_tail()}")
    if after_run.survivors:
        problems.append(describe_trial(len(trials), after_run).replace("trial", "next run", 1))
    after = lingering()
    if before & after:
        problems.append(
            f"left by killed runs, still there after the next {c.name}: {sorted(before & after)}"
        )
    # A sweep may rename what it claims before deleting it, and a run that finished
    # must not leave its own behind either: nothing new may remain.
    if after - before:
        problems.append(f"left after the next {c.name} finished: {sorted(after - before)}")
    if c.after_next is not None:
        problems += c.after_next()

    killed = sum(t.killed for t in trials)
    ran_out = [t.elapsed for t in trials if not t.killed]
    longest = f" (the other runs took up to {max(ran_out):.2f} s)" if ran_out else ""
    summary = (
        f"{c.name}: seed {SEED} (ROOTSTOCK_SIGKILL_SEED), {c.trials} kills in "
        f"(0, {duration:.2f} s){window}, "
        f"{killed} landed before it finished{longest}; "
        f"{len(left_alive)} left processes alive {GRACE_S} s later; "
        f"{len(before)} leftover(s) before the next run; "
        f"{time.monotonic() - started:.0f} s in all"
    )
    print(summary)
    if problems:
        pytest.fail(summary + "\n" + "\n".join(problems), pytrace=False)
    return summary


def kill_campaign(name: str, args: list[str], root: Path, tmpdir: Path, logs: Path) -> None:
    """The plain campaign of ``test_sigkill.py``: no preparation, no extra checks."""
    run_campaign(Campaign(name, args, root, tmpdir, logs))
