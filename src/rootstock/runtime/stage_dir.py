"""This user's stage directory on a node: its safety checks, locks, entries and cleaning.

The directory, ``.rootstock-stage-<uid>`` in ``$ROOTSTOCK_STAGE_DIR``, else ``$TMPDIR``,
else ``/tmp``, must be a real directory of this user with mode 0700: anything else is
refused, never used, because a stage another user could write is code execution as
this user. In it, each staged build has an entry ``<env>.<build-id>/``:

* ``image.sqfs``: the verified copy of the build's image;
* ``mnt/`` (a squashfuse mount) or ``tree/`` (the extracted image);
* ``users.lock``: every process with a worker on this entry holds a shared ``flock``
  on it for the worker's life; unmounting or removing the entry takes it exclusively,
  without waiting, so an entry in use is never pulled away;
* ``source.json``: the env, its link on the shared root, and the generation staged.

Staging (:mod:`rootstock.runtime.stage`) runs under the node's per-user lock
(``.lock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rootstock.errors import RootstockError
from rootstock.install.parsing import ParseProblem, loads_json
from rootstock.runtime.pool.directory import write_json_atomic

STAGE_DIR_ENV = "ROOTSTOCK_STAGE_DIR"
#: How long a staging may wait for another process's staging on this node.
STAGE_LOCK_TIMEOUT_S = 3600.0
IMAGE_FILE = "image.sqfs"
MOUNT_DIR = "mnt"
TREE_DIR = "tree"
USERS_LOCK = "users.lock"
SOURCE_FILE = "source.json"
KEEPER_FILE = "keeper.json"
PART_MARK = ".part-"


class StageRefused(RootstockError):
    """This build cannot be staged here; the message says why and what to do.

    A worker's start turns it into one warning and the shared env; ``rootstock stage``
    reports it (exit code 1).
    """


def stage_root() -> Path:
    """This user's stage directory on this node (it may not exist yet)."""
    base = os.environ.get(STAGE_DIR_ENV) or tempfile.gettempdir()
    return Path(base) / f".rootstock-stage-{os.getuid()}"


def private_stage_root(create: bool = True) -> Path:
    """:func:`stage_root`, made 0700 if missing; :class:`StageRefused` when it is not a
    real directory of this user with mode 0700 (nothing in it is used then)."""
    root = stage_root()
    if create:
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass  # checked below, whatever it is
        except OSError as exc:
            raise StageRefused(
                f"cannot make the stage directory {root}: {exc.strerror or exc}; set "
                f"${STAGE_DIR_ENV} to a node-local directory you can write"
            ) from None
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise StageRefused(f"cannot use the stage directory {root}: {exc}") from None
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "it is not a real directory"
    elif st.st_uid != os.getuid():
        problem = f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        problem = f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if problem:
        raise StageRefused(
            f"refusing the stage directory {root}: {problem}; a stage others could write "
            f"is never used. Remove it, or set ${STAGE_DIR_ENV} to another node-local "
            "directory"
        )
    return root


@contextlib.contextmanager
def node_lock(root: Path, timeout: float = STAGE_LOCK_TIMEOUT_S) -> Iterator[None]:
    """This user's staging lock on this node (``flock``, waited for up to ``timeout``)."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StageRefused(
                        f"another staging on this node held {root / '.lock'} for over "
                        f"{timeout:.0f} s"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _users_lock_fd(entry: Path) -> int:
    return os.open(entry / USERS_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def hold_shared(entry: Path) -> int:
    """A shared hold on ``entry`` (waits out a keeper's or sweep's brief exclusive one)."""
    fd = _users_lock_fd(entry)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def claim_unused(entry: Path) -> Iterator[bool]:
    """Hold ``entry`` exclusively for the body if nobody uses it (yields False else)."""
    try:
        fd = _users_lock_fd(entry)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def is_live_mount(mount: Path) -> bool:
    try:
        return os.path.ismount(mount) and os.path.isdir(mount / "bin")
    except OSError:
        return False


def detach(mount: Path) -> None:
    """Unmount ``mount`` at once if it is a mount whose server is gone."""
    try:
        os.stat(mount)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:  # the FUSE server died
            unmount(mount, lazy=True)


def unmount(mount: Path, *, lazy: bool = False) -> bool:
    """Unmount a FUSE mount of ours; False when it is busy (or not mounted)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool is not None:
        argv = [tool, "-u", *(["-z"] if lazy else []), str(mount)]
    else:
        argv = ["umount", *(["-l"] if lazy else []), str(mount)]
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def write_source(entry: Path, record: dict[str, str]) -> None:
    """Record in ``entry`` what it stages (``env``, ``env_dir``, ``generation``, ``sha256``)."""
    path = entry / SOURCE_FILE
    if not path.is_file():
        write_json_atomic(path, record)


@dataclass
class StagedEntry:
    """One entry of this user's stage directory, as ``stage --list`` shows it."""

    name: str
    path: Path
    env: str | None
    generation: str | None
    mounted: bool
    extracted: bool
    in_use: bool
    current: bool
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "env": self.env,
            "generation": self.generation,
            "mounted": self.mounted,
            "extracted": self.extracted,
            "in_use": self.in_use,
            "current": self.current,
            "bytes": self.size,
        }


def source_of(entry: Path) -> dict[str, Any]:
    try:
        data = loads_json((entry / SOURCE_FILE).read_bytes())
    except (OSError, ParseProblem):
        return {}
    return data if isinstance(data, dict) else {}


def is_current(entry: Path) -> bool:
    """Whether ``entry`` stages the build its env runs now (its link points there)."""
    source = source_of(entry)
    env_dir, generation = source.get("env_dir"), source.get("generation")
    if not isinstance(env_dir, str) or not isinstance(generation, str):
        return False
    try:
        return os.path.realpath(env_dir) == generation and os.path.isdir(generation)
    except OSError:
        return False


def in_use(entry: Path) -> bool:
    with claim_unused(entry) as claimed:
        return not claimed


def _du(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if os.path.ismount(dirpath) and Path(dirpath) != path:
            dirnames[:] = []
            continue
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def list_stages() -> list[StagedEntry]:
    """This user's stages on this node (none when the stage directory is missing)."""
    root = stage_root()
    if not root.is_dir():
        return []
    private_stage_root(create=False)
    entries = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.is_symlink() or PART_MARK in entry.name:
            continue
        source = source_of(entry)
        entries.append(
            StagedEntry(
                name=entry.name,
                path=entry,
                env=source.get("env"),
                generation=source.get("generation"),
                mounted=is_live_mount(entry / MOUNT_DIR),
                extracted=(entry / TREE_DIR).is_dir(),
                in_use=in_use(entry),
                current=is_current(entry),
                size=_du(entry),
            )
        )
    return entries


def sweep(
    root: Path, *, replaced: tuple[str, str] | None = None, everything: bool = False
) -> list[str]:
    """Remove what staging left behind (call it under :func:`node_lock`).

    Leftovers of a staging that was killed always go. Entries go only when nobody
    uses them: ``replaced`` (an env's link path and the entry of its current build,
    which a staging passes) removes the entries of that env's other builds, judged by
    what each entry recorded, so a worker's start asks the shared filesystem nothing
    more; without it, the entries
    whose build is no longer current; with ``everything``, all. Returns the names
    removed.
    """
    removed = []
    for path in list(root.iterdir()):
        if path.name == ".lock":
            continue
        if not path.is_dir() or path.is_symlink():
            if PART_MARK in path.name:
                _remove(path)
            continue
        for part in path.glob(f"*{PART_MARK}*"):
            _remove(part)
        if replaced is not None:
            env_dir, current = replaced
            if path.name == current or source_of(path).get("env_dir") != env_dir:
                continue
        elif not everything and is_current(path):
            continue
        if remove_entry(path):
            removed.append(path.name)
    return removed


def remove_entry(entry: Path) -> bool:
    """Unmount and delete ``entry`` if nobody uses it; False when in use (or busy)."""
    with claim_unused(entry) as claimed:
        if not claimed:
            return False
        mount = entry / MOUNT_DIR
        detach(mount)
        if os.path.ismount(mount) and not unmount(mount):
            return False
        _remove(entry)
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_stages(*, everything: bool = True) -> tuple[list[str], list[str]]:
    """``stage --clean``: remove this user's unused stages on this node.

    Returns the names removed and those kept because a worker uses them.
    """
    root = stage_root()
    if not root.is_dir():
        return [], []
    private_stage_root(create=False)
    with node_lock(root):
        removed = sweep(root, everything=everything)
    kept = [
        p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name != ".lock"
    ]
    if everything and not kept:
        with contextlib.suppress(OSError):
            (root / ".lock").unlink()
            root.rmdir()
    return removed, kept
