"""Builds shared by every pytest process of one test run.

A real uv build is the dearest thing the suite does, and ``scripts/test`` runs
pytest in several worker processes (pytest-xdist): a session fixture would build
the same root once per worker. Instead, the first process that needs a shared root
builds it under a file lock in the run's directory; the others wait on the lock and
then use the same, finished directory. Shared roots are never modified by tests.

The run's directory is ``$ROOTSTOCK_TEST_RUN_DIR``. The first pytest process of a
run (the xdist controller, or a plain pytest) makes it in ``pytest_configure`` and
removes it at the end; the worker processes inherit the variable. A directory named
in the environment beforehand is used as it is and left in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

RUN_DIR_ENV = "ROOTSTOCK_TEST_RUN_DIR"
_DONE = ".done"


def make_run_dir() -> Path | None:
    """Make the run's directory unless one is already named; return it if made here."""
    if os.environ.get(RUN_DIR_ENV):
        return None
    made = Path(tempfile.mkdtemp(prefix="rs-test-run-"))
    os.environ[RUN_DIR_ENV] = str(made)
    return made


def run_dir() -> Path:
    """The run's directory (made on first use when no pytest hook made it)."""
    if not os.environ.get(RUN_DIR_ENV):
        make_run_dir()
    return Path(os.environ[RUN_DIR_ENV])


@contextlib.contextmanager
def run_lock(name: str) -> Iterator[None]:
    """Hold the run-wide lock ``name`` (blocks until every other holder lets go)."""
    with open(run_dir() / f"{name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def shared_build(name: str, build: Callable[[Path], object]) -> Path:
    """``run_dir()/name``, made once per run by ``build(path)``.

    A build that raised leaves no mark: the next process to ask tries again (and
    fails the same way, with its own traceback), starting from an empty path.
    """
    target = run_dir() / name
    mark = run_dir() / f"{name}{_DONE}"
    with run_lock(name):
        if not mark.exists():
            if target.exists():
                shutil.rmtree(target)
            build(target)
            mark.touch()
    return target


def link_live_tree(source: Path, target: Path) -> None:
    """Hard-link copy of ``source``, a tree other processes may be writing (a uv cache).

    Entries that vanish during the walk are left out, and so are in-flight temp
    entries (``.tmp*``). Lock files are made anew rather than linked: a linked
    ``.lock`` is the same inode, and a lock on the copy would be a lock on the original.
    """
    for dirpath, dirnames, filenames in os.walk(source):
        here = Path(dirpath)
        there = target / here.relative_to(source)
        there.mkdir(parents=True, exist_ok=True)
        dirnames[:] = [name for name in dirnames if not name.startswith(".tmp")]
        for name in dirnames:
            if (here / name).is_symlink():
                _copy_link(here / name, there / name)
        for name in filenames:
            if name.startswith(".tmp"):
                continue
            if name == ".lock":
                (there / name).touch()
                continue
            with contextlib.suppress(FileNotFoundError):
                if (here / name).is_symlink():
                    _copy_link(here / name, there / name)
                else:
                    os.link(here / name, there / name)


def _copy_link(link: Path, copy: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        copy.symlink_to(os.readlink(link))
