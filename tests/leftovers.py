"""What a test run left behind: processes, FUSE mounts and run dirs.

Every process a test starts inherits ``$ROOTSTOCK_TEST_RUN_DIR`` (set once per run,
see :mod:`tests.run_cache`), and so does every process those start: workers, pool
daemons, uv, SLURM jobs submitted with the caller's environment. At the end of the
run, the first pytest process looks for every process of its user whose environment
holds that exact assignment, for mounts below the run's directories, and for run
directories (``rootstock-*``) left in the run's ``$TMPDIR``, and for node-local stage
directories (``.rootstock-stage-*``) there or in the tests' temp dirs. Anything found fails
the run, named, and is then removed, so that nothing outlives the run either way. A run
dir whose owner has died is first removed by the product's own sweep, which every new
run dir's maker runs (the run's end has no next maker): it is reported, not failed.
``rootstock-<uid>`` is not a run dir but the user's lasting directory (the pool and
compiler cache fallback), which the product's own sweep of dead run dirs skips too.

The checking process's own live descendants, and the run dirs they or it made, are not
leftovers: they end with it (a worker's lifeline, a session's exit finalizer, the
multiprocessing resource tracker). Under pytest-xdist the workers have exited by then,
so whatever they left is seen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rootstock.runtime.server import sweep_dead_run_dirs
from tests.run_cache import RUN_DIR_ENV

#: Time for teardowns still under way (xdist workers exiting, daemons idling out).
SETTLE_S = 30.0
RUN_DIR_PREFIX = "rootstock-"
STAGE_GLOB = ".rootstock-stage-*"


@dataclass
class Leftovers:
    processes: list[tuple[int, str]] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    run_dirs: list[Path] = field(default_factory=list)
    stages: list[Path] = field(default_factory=list)
    #: Run dirs of processes that had died, removed by the product's own sweep (the
    #: one every new run dir's maker runs): reported, not a failure.
    swept: list[Path] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.mounts or self.run_dirs or self.stages)

    def lines(self) -> list[str]:
        out = [f"process {pid}: {cmd}" for pid, cmd in self.processes]
        out += [f"mount: {point}" for point in self.mounts]
        out += [f"run dir: {path}" for path in self.run_dirs]
        out += [f"stage directory: {path}" for path in self.stages]
        return out


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return pids


def _descendants() -> set[int]:
    """This process's live descendants."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(name))
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def marked_processes(run_dir: Path) -> list[tuple[int, str]]:
    """Live processes of the run (not zombies, not this one, its ancestors or its own
    descendants)."""
    marker = f"{RUN_DIR_ENV}={run_dir}".encode()
    skip = _ancestors() | _descendants()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue  # gone, or another user's
        if marker in environ.split(b"\0") and cmdline:
            found.append((int(name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


def mounts_below(dirs: list[Path]) -> list[str]:
    """Mount points at or below any of ``dirs`` (from this process's mountinfo)."""
    prefixes = [str(d.resolve()) for d in dirs]
    points = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].replace("\\040", " ")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                points.append(point)
    return points


def find_leftovers(
    run_dir: Path, tmp_dir: Path, temp_roots: list[Path], settle_s: float = SETTLE_S
) -> Leftovers:
    """What the run left, waiting up to ``settle_s`` for processes still exiting."""
    deadline = time.monotonic() + settle_s
    processes = marked_processes(run_dir)
    while processes and time.monotonic() < deadline:
        time.sleep(0.5)
        processes = marked_processes(run_dir)
    # rootstock-<uid> is the user's lasting directory, never a run dir (as in
    # rootstock.runtime.server.sweep_dead_run_dirs).
    lasting = f"{RUN_DIR_PREFIX}{os.getuid()}"
    # A run dir's name carries its maker's pid: rootstock-<pid>-<random>.
    ours = {f"{RUN_DIR_PREFIX}{pid}-" for pid in _descendants() | {os.getpid()}}
    # A run dir whose maker died (killed, or a pytest-xdist worker stopped before its
    # exit finalizers ran) is removed by the next maker's sweep in the product; at the
    # end of the run there is no next maker, so the same sweep runs here. What is
    # left after it belongs to a live process, or has no owner record.
    swept = [
        p
        for p in sweep_dead_run_dirs(tmp_dir)
        if not any(p.name.startswith(prefix) for prefix in ours)
    ]
    run_dirs = []
    with contextlib.suppress(OSError):
        run_dirs = sorted(
            p
            for p in tmp_dir.iterdir()
            if p.name.startswith(RUN_DIR_PREFIX)
            and p.name != lasting
            and not any(p.name.startswith(prefix) for prefix in ours)
        )
    return Leftovers(
        processes,
        mounts_below([run_dir, *temp_roots]),
        run_dirs,
        stage_dirs(tmp_dir, temp_roots),
        sorted(swept),
    )


def stage_dirs(tmp_dir: Path, temp_roots: list[Path]) -> list[Path]:
    """Node-local stage directories (``.rootstock-stage-<uid>``, rootstock.runtime.stage_dir)
    in the run's temp dir, or in a test's ``tmp_path`` (at most three levels below a temp
    root, where the tests' ``$ROOTSTOCK_STAGE_DIR`` lies)."""
    patterns = [STAGE_GLOB, f"*/{STAGE_GLOB}", f"*/*/{STAGE_GLOB}", f"*/*/*/{STAGE_GLOB}"]
    found: list[Path] = []
    with contextlib.suppress(OSError):
        found += tmp_dir.glob(STAGE_GLOB)
    for top in temp_roots:
        for pattern in patterns[1:]:
            with contextlib.suppress(OSError):
                found += top.glob(pattern)
    return sorted(set(found))


def remove_leftovers(found: Leftovers) -> None:
    """Kill, unmount and delete what :func:`find_leftovers` found."""
    for pid, _ in found.processes:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for point in reversed(found.mounts):
        # fuse3's tool, fuse 2's, then the kernel's lazy unmount (root).
        for command in (["fusermount3", "-u", "-z"], ["fusermount", "-u", "-z"], ["umount", "-l"]):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                done = subprocess.run(
                    [*command, point], check=False, timeout=60, capture_output=True
                )
                if done.returncode == 0:
                    break
    for path in [*found.run_dirs, *found.stages]:
        shutil.rmtree(path, ignore_errors=True)
