"""SIGKILL a command at a chosen moment and report every process of it still alive later.

A kill trial runs inside a small harness process (this file, run as a script). The
harness makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``), so a
process the command left behind is re-parented to the harness instead of to init,
whatever session or process group it moved to (uv's children under a build
supervisor, a worker still retrying its connect). Every process of the command is
then a descendant of the harness, found by walking ``/proc/*/stat``.

The harness starts the command, sends SIGKILL to the command's own process only (as
the out-of-memory killer or ``kill -9`` would; its children get no signal), then
watches the descendants for ``grace`` seconds, reaping the ones that exit. Whatever
is alive at the end of the grace period is a survivor: it is listed in the report,
then killed and reaped, so no trial leaks into the next. The report is one JSON
object on stdout.

The test side uses :func:`run_trial`, which starts the harness in its own session
with a deadline and kills it, group and all, if it overruns. Stdlib only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.05
# How long the harness waits for killed leftovers to disappear before giving up.
REAP_LIMIT_S = 10.0


# -- the harness (runs in its own process) -------------------------------------------


def _state(stat: str) -> str | None:
    """The state letter in a ``/proc/.../stat`` file, or None when it is gone."""
    try:
        with open(stat) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan may wait for a reaper)."""
    return _state(f"/proc/{pid}/stat") not in (None, "Z", "X")


def is_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is stopped (a SIGSTOP is delivered thread by
    thread: ``kill`` returns before the last one stops)."""
    states = [_state(f"{task}/stat") for task in Path(f"/proc/{pid}/task").glob("*")]
    return bool(states) and all(state in ("T", "t") for state in states)


def become_subreaper() -> None:
    """Adopt every orphaned descendant (Linux 3.4+); raise if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid`` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # comm may hold spaces and parentheses; the fields after the last ')' do not.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def live_descendants(ancestor: int) -> list[int]:
    """Pids of every non-zombie process below ``ancestor`` in the process tree."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        info = _stat(int(entry))
        if info is None:
            continue
        states[int(entry)] = info[0]
        children.setdefault(info[1], []).append(int(entry))
    found: list[int] = []
    stack = list(children.get(ancestor, ()))
    while stack:
        pid = stack.pop()
        if states.get(pid) not in ("Z", "X"):
            found.append(pid)
        stack.extend(children.get(pid, ()))
    return sorted(found)


def worker_children(root: Path) -> list[int]:
    """This process's live children that run a rootstock worker of ``root``."""
    found = []
    needle = str(root).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        info = _stat(int(entry))
        if info is None or info[1] != os.getpid() or info[0] == "Z":
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"rootstock.worker" in cmdline and needle in cmdline:
            found.append(int(entry))
    return found


def describe(pid: int) -> dict[str, Any]:
    """What a survivor is: its pid, parent, session, name and command line."""
    info: dict[str, Any] = {"pid": pid}
    stat = _stat(pid)
    if stat is not None:
        info["state"], info["ppid"] = stat
    with contextlib.suppress(OSError):
        info["sid"] = os.getsid(pid)
    with contextlib.suppress(OSError):
        info["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        info["cmdline"] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:400]
    return info


def reap_children() -> None:
    """Collect every exited child (the command itself and adopted orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_everything_below(ancestor: int) -> list[int]:
    """SIGKILL and reap every descendant until none is left; return any that would not go."""
    deadline = time.monotonic() + REAP_LIMIT_S
    while True:
        pids = live_descendants(ancestor)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reap_children()
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(POLL_S)


def watch_until_gone(ancestor: int, grace: float) -> tuple[list[int], float | None]:
    """Poll the descendants for ``grace`` s; return (survivors, seconds until none was left)."""
    start = time.monotonic()
    while True:
        reap_children()
        alive = live_descendants(ancestor)
        elapsed = time.monotonic() - start
        if not alive:
            return [], elapsed
        if elapsed >= grace:
            return alive, None
        time.sleep(POLL_S)


def kill_after_mark(
    proc: subprocess.Popen, spec: dict[str, Any], mark: bytes, delay: float, start: float,
    report: dict[str, Any],
) -> bool:  # fmt: skip
    """SIGKILL ``proc`` ``delay`` s after ``mark`` first shows in its output; True if killed.

    A run that ends before that moment (or before the mark) is not killed.
    """
    deadline: float | None = None
    while proc.poll() is None:
        now = time.monotonic()
        if deadline is None:
            seen = any(mark in Path(spec[name]).read_bytes() for name in ("stdout", "stderr"))
            if seen:
                report["mark_at"] = now - start
                deadline = now + delay
        if deadline is not None and now >= deadline:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(POLL_S / 5)
    return False


def harness(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one trial as ``spec`` says; see the module docstring. Returns the report."""
    become_subreaper()
    me = os.getpid()

    def on_deadline(signum, frame):  # the harness must never leave its trial behind
        kill_everything_below(me)
        os._exit(3)

    signal.signal(signal.SIGALRM, on_deadline)
    signal.signal(signal.SIGTERM, on_deadline)
    signal.alarm(int(spec["deadline"]))

    kill_after = spec.get("kill_after")
    mark = spec.get("after_mark")
    report: dict[str, Any] = {"kill_after": kill_after, "mark_at": None}
    with open(spec["stdout"], "wb") as out, open(spec["stderr"], "wb") as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            spec["argv"], env=spec["env"], stdin=subprocess.DEVNULL, stdout=out, stderr=err
        )
    if mark is None:
        try:
            proc.wait(timeout=kill_after)
            report["killed"] = False
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            report["killed"] = True
    else:
        report["killed"] = kill_after_mark(proc, spec, mark.encode(), kill_after, start, report)
    report["elapsed"] = time.monotonic() - start
    report["returncode"] = proc.returncode
    survivors, cleared = watch_until_gone(me, float(spec["grace"]))
    report["cleared_after"] = cleared
    report["survivors"] = [describe(pid) for pid in survivors]
    report["unkillable"] = kill_everything_below(me)
    return report


# -- the test side ---------------------------------------------------------------------


@dataclass
class TrialResult:
    """One trial's report, plus the command's captured output."""

    kill_after: float | None
    mark_at: float | None
    killed: bool
    elapsed: float
    returncode: int
    cleared_after: float | None
    survivors: list[dict[str, Any]] = field(default_factory=list)
    unkillable: list[int] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""

    def output_tail(self, chars: int = 1500) -> str:
        """The end of the command's stdout and stderr, for a failure message."""
        return (self.stdout[-chars:] + "\n" + self.stderr[-chars:]).strip()


def run_trial(
    argv: list[str],
    env: dict[str, str],
    log_dir: Path,
    *,
    kill_after: float | None,
    grace: float = 5.0,
    timeout: float = 300.0,
    after_mark: str | None = None,
) -> TrialResult:
    """Run ``argv`` under the harness; SIGKILL it after ``kill_after`` s (None: never).

    With ``after_mark``, the ``kill_after`` s count from the moment that text first
    shows in the command's output (``mark_at`` in the result), not from its start.
    Survivors are the processes of the command still alive ``grace`` s after it was
    killed (or after it exited on its own). The harness gets ``timeout`` s in all.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": argv,
        "env": env,
        "kill_after": kill_after,
        "after_mark": after_mark,
        "grace": grace,
        "deadline": timeout,
        "stdout": str(log_dir / "stdout"),
        "stderr": str(log_dir / "stderr"),
    }
    proc = subprocess.Popen(
        [sys.executable, __file__, json.dumps(spec)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # The harness's own alarm fires at `timeout`; this is the backstop behind it.
        out, err = proc.communicate(timeout=timeout + REAP_LIMIT_S + 10)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    if proc.returncode != 0:
        raise AssertionError(f"kill harness failed ({proc.returncode}):\n{out}\n{err}")
    report = json.loads(out)
    return TrialResult(
        **report,
        stdout=(log_dir / "stdout").read_text(errors="replace"),
        stderr=(log_dir / "stderr").read_text(errors="replace"),
    )


if __name__ == "__main__":
    print(json.dumps(harness(json.loads(sys.argv[1]))))
