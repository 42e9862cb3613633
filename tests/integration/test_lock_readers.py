"""A user who can read a shared install cannot stall its maintainers' writes.

A POSIX read lock needs only read access, and it conflicts with the exclusive
lock every writer takes (``fd = open(path, O_RDONLY); lockf(fd, LOCK_SH)``). So the
install's lock files (``.locks/manifest.lock``, ``root.lock``, ``env-*.lock``) are
open to the maintainers alone. Here another account (uid 65534, in no group of
the install) tries exactly that on a root set up as a shared install (group-owned,
setgid, umask 002), and the maintainer's manifest write, root lock and build lock
go through at once. A holder that *can* lock (a maintainer's process) is named by
its pid in the timeout.

Runs as root: it switches to the other account with ``setpriv``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.errors import LockTimeout
from rootstock.install.build import env_build_lock, root_lock, write_build_owner
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import manifest_lock_path, update_manifest
from tests.conftest import REPO, ROOTSTOCK

OTHER_UID = 65534  # nobody, in group nogroup: in no group of the install
PROJECT_GID = 100  # users: the install's group, as setup-perms would chgrp it

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="switches to another uid: needs root"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)"),
]

READER = textwrap.dedent(
    """
    import fcntl, json, os, sys

    outcome = {}
    for path in sys.argv[1:]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            outcome[path] = "open: " + exc.strerror
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            outcome[path] = "held"
        except OSError as exc:
            outcome[path] = "lockf: " + exc.strerror
    print(json.dumps(outcome), flush=True)
    sys.stdin.read()  # hold whatever was taken until the test closes our stdin
    """
)

HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from rootstock.install.locking import FileLock

    with FileLock(Path(sys.argv[1]), timeout=30, private=True):
        print("locked", flush=True)
        sys.stdin.read()
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture
def shared_root() -> Iterator[InstallLayout]:
    """An initialised root as setup-perms leaves it: group-owned, setgid, umask 002.

    Under a world-traversable directory of its own (pytest's temp dir is 0700,
    which would keep the other account out whatever the install's modes are).
    """
    base = Path(tempfile.mkdtemp(prefix="rootstock-shared-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        root = base / "install"
        root.mkdir()
        os.chown(root, -1, PROJECT_GID)
        os.chmod(root, 0o2775)
        subprocess.run(
            [*ROOTSTOCK, "init", "--root", str(root), "--cluster", "testbox", "--yes"],
            check=True,
            env={**_env(), "ROOTSTOCK_CONFIG": str(base / "config.toml")},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
        )
        layout = InstallLayout(root, root)
        # Every lock the maintainers take exists once it has been taken once.
        with root_lock(layout, timeout=10):
            pass
        with env_build_lock(layout, "emt"):
            pass
        yield layout
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Process:
    """A child started with a deadline on its first line, killed in teardown."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
        )

    def first_line(self, deadline_s: float = 60) -> str:
        timer = threading.Timer(deadline_s, self.proc.kill)
        timer.start()
        try:
            return self.proc.stdout.readline().strip()
        finally:
            timer.cancel()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in started:
        process.stop()


def _lock_paths(layout: InstallLayout) -> list[Path]:
    return [
        manifest_lock_path(layout),
        layout.locks_dir / "root.lock",
        layout.locks_dir / "env-emt.lock",
    ]


def test_another_user_cannot_hold_off_the_maintainers(shared_root, processes):
    layout = shared_root
    paths = _lock_paths(layout)
    assert all(p.is_file() for p in paths)
    reader = Process(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
         sys.executable, "-c", READER, *map(str, paths)]
    )  # fmt: skip
    processes.append(reader)
    outcome = json.loads(reader.first_line())
    assert set(outcome) == set(map(str, paths))
    assert "held" not in outcome.values(), outcome

    # The maintainer's writes go through while the reader is still there.
    start = time.monotonic()
    assert update_manifest(layout, lambda m: m["clusters"], timeout=10) == ["testbox"]
    with root_lock(layout, timeout=10):
        pass
    build_lock = env_build_lock(layout, "emt")
    assert build_lock.acquire(blocking=False) is True
    build_lock.release()
    proc = subprocess.run(
        [*ROOTSTOCK, "manifest", "init", "--root", str(layout.root), "--cluster", "other",
         "--no-push"],
        env={**_env(), "ROOTSTOCK_CONFIG": str(layout.root.parent / "config.toml")},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 30  # the default lock timeout is 60 s


def test_a_lock_directory_left_open_is_closed_by_the_next_lock(shared_root, processes):
    """An install whose ``.locks`` an older version made world-searchable, with
    world-readable lock files: the owner's next lock closes it to others."""
    layout = shared_root
    os.chmod(layout.locks_dir, 0o2775)
    for path in _lock_paths(layout):
        os.chmod(path, 0o664)
    update_manifest(layout, lambda m: None, timeout=10)
    reader = Process(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
         sys.executable, "-c", READER, *map(str, _lock_paths(layout))]
    )  # fmt: skip
    processes.append(reader)
    outcome = json.loads(reader.first_line())
    assert "held" not in outcome.values(), outcome
    assert update_manifest(layout, lambda m: m["clusters"], timeout=10) == ["testbox"]


def test_the_timeout_names_the_holders_pid(shared_root, processes):
    layout = shared_root
    holder = Process([sys.executable, "-c", HOLDER, str(manifest_lock_path(layout))])
    processes.append(holder)
    assert holder.first_line() == "locked"
    with pytest.raises(LockTimeout) as info:
        update_manifest(layout, lambda m: None, timeout=0.5)
    assert f"pid {holder.proc.pid}" in info.value.message, info.value.message
    assert str(manifest_lock_path(layout)) in info.value.message
    assert f"ps -o user,etime,args -p {holder.proc.pid}" in (info.value.hint or "")
    # The build lock never waits: its refusal names the holder the same way.
    building = Process([sys.executable, "-c", HOLDER, str(layout.locks_dir / "env-emt.lock")])
    processes.append(building)
    assert building.first_line() == "locked"
    described = env_build_lock(layout, "emt").holder()
    assert described is not None and described.startswith(f"pid {building.proc.pid} (user root")


def test_another_user_still_sees_a_build_in_progress(shared_root, processes):
    """``status`` for a user who cannot open the lock files: a build's owner record
    in ``.build/`` says an env is building (no lock a reader could take)."""
    layout = shared_root
    registered = layout.environments_dir / "emt.py"
    shutil.copyfile(REPO / "environments" / "emt.py", registered)
    os.chmod(registered, 0o644)
    with env_build_lock(layout, "emt"):
        # What an install does first: holds the build lock, then writes the record.
        owner = write_build_owner(layout, "emt")
        try:
            assert _status_as_other_user(layout) == "building"
        finally:
            owner.unlink()
    assert _status_as_other_user(layout) == "not built"


def _status_as_other_user(layout: InstallLayout) -> str:
    """The state ``rootstock status --json`` shows the other account for env emt."""
    proc = subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--",
         sys.executable, "-m", "rootstock.cli.main", "status", "--json",
         "--root", str(layout.root)],
        env={**_env(), "HOME": "/tmp", "ROOTSTOCK_CONFIG": "/nonexistent/config.toml"},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (state,) = [env["state"] for env in json.loads(proc.stdout)["envs"] if env["name"] == "emt"]
    return state
