"""The build supervisor: a build subprocess runs in its own process group, which
dies with the ``rootstock`` process that started it.

A killed ``rootstock install`` used to leave uv (and uv's own children: bytecode
compilers, sdist builds) running for many seconds, writing into a staging
directory nobody would ever use. Every subprocess of a build therefore runs as::

    python -m rootstock.install.supervise --lifeline-fd N -- CMD...

The supervisor starts CMD in a new session (so CMD and everything it spawns form
one process group), relays CMD's exit status, forwards SIGTERM, SIGINT and SIGHUP
to the group, and ends the group (SIGTERM, then SIGKILL after
:data:`KILL_GRACE_S`) when the lifeline (:mod:`rootstock.wire.lifeline`)
reaches end-of-file, that is when the starter is gone however it died. When CMD
exits, leftover members of its group are ended the same way.

:func:`run_supervised` is the starter's side, with ``subprocess.run``'s shape. It
starts the supervisor in a session of its own too, so a signal sent to the
starter's whole process group (``kill -9 -PGID``, a terminal's Ctrl-C) reaches the
starter alone, and the supervisor survives it long enough to clean up. Stdlib only,
like the lifeline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

if __name__ == "__main__" and not __package__:
    # Run by path under -I (supervisor_command): import the rootstock this file is part of.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rootstock.wire.lifeline import (
    LIFELINE_OPTION,
    Lifeline,
    watch_lifeline,
)

#: Seconds between the SIGTERM and the SIGKILL that end a process group.
KILL_GRACE_S = 2.0
#: The supervisor's exit status when its lifeline is lost (nobody is left to read it).
LIFELINE_LOST_EXIT = 125
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` that still run (zombies left out).

    Zombies are excluded because orphans are reaped by init, which in some
    containers takes seconds: they hold no files and run nothing. Without
    ``/proc`` any member counts, zombies included.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:  # a member exists but is not ours (a setuid helper)
            pass
        return [pgid]
    members = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.append(int(entry))
    return members


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux ``/proc``); tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None


def process_alive(pid: int, start_time: str | None = None) -> bool:
    """Whether ``pid`` runs on this host and, given ``start_time``, is that same process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    now = process_start_time(pid)
    return start_time is None or now is None or now == start_time


def end_group(pgid: int, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM every member of ``pgid``; SIGKILL whatever is left after ``grace`` s."""
    if not group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_members(pgid):
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            # SIGKILL lands at once unless a member is stuck in the kernel (D state).
            settle = time.monotonic() + 1.0
            while group_members(pgid) and time.monotonic() < settle:
                time.sleep(0.02)
            return
        time.sleep(0.05)


class _Supervisor:
    """CMD's process group and the one cleanup both threads may trigger."""

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.pending: list[int] = []
        self._ending = threading.Lock()

    def forward(self, signum: int, _frame: FrameType | None = None) -> None:
        if self.pgid is None:
            # Arrived before CMD exists: replayed as soon as it does.
            self.pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def end(self) -> None:
        # The lifeline thread and the main thread (CMD exited) may both get here;
        # the lock makes the second wait until the first has finished the group.
        if self.pgid is None:
            return
        with self._ending:
            end_group(self.pgid)

    def lifeline_lost(self) -> None:
        self.end()
        os._exit(LIFELINE_LOST_EXIT)


def supervise(lifeline_fd: int, cmd: Sequence[str]) -> int:
    """Run ``cmd`` in its own process group tied to ``lifeline_fd``; its exit status."""
    state = _Supervisor()
    for signum in _FORWARDED:
        signal.signal(signum, state.forward)
    try:
        # Signals still caught at exec are reset to the default in CMD; the
        # lifeline fd is not passed on (close_fds), so CMD cannot keep it open.
        child = subprocess.Popen(list(cmd), start_new_session=True)
    except OSError as exc:
        print(f"rootstock supervisor: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    state.pgid = child.pid
    for pending in state.pending:
        state.forward(pending)
    # Watched only now: a lifeline already at EOF must find a group to end.
    watch_lifeline(lifeline_fd, state.lifeline_lost)
    code = child.wait()
    state.end()
    return code


def _exit_like(code: int) -> int:
    """Die of CMD's signal if it died of one, so the starter sees the same status."""
    if code >= 0:
        return code
    signum = -code
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return 128 + signum


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``--lifeline-fd N -- CMD...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m rootstock.install.supervise {LIFELINE_OPTION} N -- CMD..."
    try:
        if args[0] != LIFELINE_OPTION or args[2] != "--" or len(args) < 4:
            raise ValueError
        fd = int(args[1])
    except (IndexError, ValueError):
        print(usage, file=sys.stderr)
        return 2
    return _exit_like(supervise(fd, args[3:]))


def supervisor_command(lifeline_fd: int, cmd: Sequence[str]) -> list[str]:
    """The argv that runs ``cmd`` under the supervisor, on this very interpreter.

    The supervisor is run by file path with ``-I``: it imports this same rootstock
    (see the ``__main__`` block), even from a checkout on ``PYTHONPATH``, and no
    variable of the build's environment can change how it starts.
    """
    return [sys.executable, "-I", __file__, LIFELINE_OPTION, str(lifeline_fd), "--", *cmd]


def run_supervised(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout: int | None = subprocess.PIPE,
    stderr: int | None = subprocess.PIPE,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` under the supervisor, like ``subprocess.run(..., text=True)``.

    Stdin is ``/dev/null``. On ``timeout`` or any exception here (Ctrl-C) the
    lifeline is closed, so the supervisor ends the whole group, and
    :class:`subprocess.TimeoutExpired` (or the exception) is raised once it has.
    """
    lifeline = Lifeline()
    try:
        proc = subprocess.Popen(
            supervisor_command(lifeline.child_fd, cmd),
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            text=True,
            pass_fds=(lifeline.child_fd,),
            start_new_session=True,
        )
    except BaseException:
        lifeline.close()
        raise
    lifeline.child_started()
    out: str | None
    err: str | None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop(proc, lifeline)
        raise subprocess.TimeoutExpired(list(cmd), timeout or 0.0, out, err) from None
    except BaseException:
        _stop(proc, lifeline)
        raise
    finally:
        lifeline.close()
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _stop(proc: subprocess.Popen, lifeline: Lifeline) -> tuple[str | None, str | None]:
    """Cut the lifeline and collect what the supervisor still says while it cleans up."""
    lifeline.close()
    try:
        return proc.communicate(timeout=KILL_GRACE_S + 10)
    except subprocess.TimeoutExpired:
        # The supervisor itself is stuck: the last resort loses CMD's group.
        proc.kill()
        return proc.communicate()


if __name__ == "__main__":
    sys.exit(main())
