"""The build supervisor ends its command's whole process group.

Real processes (``sh`` and ``sleep``) under the real supervisor: the group goes
when the lifeline reaches EOF, when the command exits with children left over,
and when ``run_supervised`` times out; exit statuses and signals are relayed.
Each ``sh`` prints ``$$`` first: it is the session leader, so that is the pgid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rootstock.install.supervise import (
    KILL_GRACE_S,
    LIFELINE_LOST_EXIT,
    main,
    run_supervised,
    supervisor_command,
)
from rootstock.wire.lifeline import Lifeline

pytestmark = pytest.mark.timeout(60)

TWO_SLEEPERS = "echo $$; sleep 60 & sleep 60 & wait"


def running_in_group(pgid: int) -> list[int]:
    """Pids of group ``pgid`` that are not zombies (read from /proc, independently)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        state, _ppid, group = stat[stat.rfind(b")") + 2 :].split()[:3]
        if int(group) == pgid and state not in (b"Z", b"X"):
            pids.append(int(entry.name))
    return pids


def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate``; return the seconds it took, or fail after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def groups():
    """Process groups (and supervisors) a test started; all SIGKILLed at teardown."""
    started: list[int] = []
    procs: list[subprocess.Popen] = []
    yield started, procs
    for pgid in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)


def start_supervised(script: str, groups) -> tuple[subprocess.Popen, Lifeline, int]:
    """Start ``sh -c script`` under the supervisor; return it, its lifeline and the pgid."""
    started, procs = groups
    lifeline = Lifeline()
    proc = subprocess.Popen(
        supervisor_command(lifeline.child_fd, ["sh", "-c", script]),
        pass_fds=(lifeline.child_fd,),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lifeline.child_started()
    procs.append(proc)
    started.append(proc.pid)
    pgid = int(proc.stdout.readline())
    started.append(pgid)
    return proc, lifeline, pgid


def test_lifeline_eof_ends_the_whole_group(groups):
    proc, lifeline, pgid = start_supervised(TWO_SLEEPERS, groups)
    wait_until(lambda: len(running_in_group(pgid)) == 3, 10, "sh and both sleeps running")
    lifeline.close()  # what the kernel does when the starter is SIGKILLed
    wait_until(lambda: not running_in_group(pgid), 3, "group ended after lifeline EOF")
    assert proc.wait(timeout=3) == LIFELINE_LOST_EXIT


def test_group_ignoring_sigterm_is_killed_after_the_grace(groups):
    # An ignored signal stays ignored in the children: the sleeps ignore SIGTERM too.
    proc, lifeline, pgid = start_supervised("trap '' TERM; " + TWO_SLEEPERS, groups)
    wait_until(lambda: len(running_in_group(pgid)) == 3, 10, "sh and both sleeps running")
    lifeline.close()
    took = wait_until(lambda: not running_in_group(pgid), KILL_GRACE_S + 3, "SIGKILL escalation")
    assert took >= KILL_GRACE_S - 0.5, "the group should have had its SIGTERM grace first"
    assert proc.wait(timeout=3) == LIFELINE_LOST_EXIT


def test_exit_status_is_relayed_and_leftovers_are_ended(groups):
    proc, _lifeline, pgid = start_supervised("echo $$; sleep 60 & exit 7", groups)
    assert proc.wait(timeout=10) == 7
    # The supervisor exits only once the backgrounded sleep is gone.
    assert running_in_group(pgid) == []


def test_sigterm_to_the_supervisor_reaches_the_group(groups):
    proc, _lifeline, pgid = start_supervised("echo $$; exec sleep 60", groups)
    wait_until(lambda: running_in_group(pgid) == [pgid], 10, "sleep running")
    proc.send_signal(signal.SIGTERM)
    # The command died of SIGTERM, and so does the supervisor: the starter sees -15.
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert running_in_group(pgid) == []


def test_run_supervised_timeout_ends_the_whole_group():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_supervised(["sh", "-c", TWO_SLEEPERS], timeout=1)
    pgid = int(caught.value.output.split()[0])
    try:
        assert time.monotonic() - start < 1 + KILL_GRACE_S + 3
        wait_until(lambda: not running_in_group(pgid), 2, "group ended after the timeout")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def test_run_supervised_returns_like_subprocess_run():
    proc = run_supervised(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


def test_a_missing_command_is_exit_127_and_bad_usage_is_2():
    assert run_supervised(["/nonexistent/rootstock-test-cmd"]).returncode == 127
    assert main(["--lifeline-fd", "x", "--", "true"]) == 2
    assert main(["true"]) == 2
