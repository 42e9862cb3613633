"""Lock files in one process: what a lock path may be, and who may open it.

A lock path that is a FIFO, a symlink or a directory is refused with a clear
error naming it (never a hang, never a raw OSError). Lock files and the private
lock directory of an install (``.locks``) give others no access at all: a POSIX
read lock needs only read access and conflicts with a writer's exclusive lock, so
anyone who could open a lock file could stall every maintainer's writes.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from rootstock.errors import LockTimeout, RootstockError
from rootstock.install.locking import FileLock, is_locked, probe_lock

pytestmark = pytest.mark.timeout(30)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _refusal(path: Path) -> RootstockError:
    with pytest.raises(RootstockError) as info:
        FileLock(path, timeout=1).acquire()
    assert not isinstance(info.value, LockTimeout)
    assert str(path) in info.value.message
    assert info.value.hint is not None and f"rm {path}" in info.value.hint
    return info.value


def test_a_fifo_lock_path_is_refused_and_probing_it_never_hangs(tmp_path):
    path = tmp_path / "manifest.lock"
    os.mkfifo(path)
    # Opening a FIFO for reading blocks until a writer comes: status must not.
    result: list[object] = []
    probe = threading.Thread(target=lambda: result.append(is_locked(path)), daemon=True)
    probe.start()
    probe.join(timeout=10)
    assert result == [False], "is_locked hung on a FIFO"
    assert probe_lock(path) is None
    assert "not a regular file" in _refusal(path).message


def test_a_symlink_lock_path_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    path = tmp_path / "root.lock"
    path.symlink_to(target)  # dangling: following it would create the target
    assert "symbolic link" in _refusal(path).message
    assert not target.exists()
    target.write_text("")
    assert "symbolic link" in _refusal(path).message
    assert probe_lock(path) is None


def test_a_directory_lock_path_is_refused(tmp_path):
    path = tmp_path / "env-emt.lock"
    path.mkdir()
    assert "not a regular file" in _refusal(path).message
    assert probe_lock(path) is None


def test_a_lock_directory_that_is_a_file_is_refused(tmp_path):
    locks = tmp_path / ".locks"
    locks.write_text("")
    path = locks / "root.lock"
    with pytest.raises(RootstockError) as info:
        FileLock(path, timeout=1, private=True).acquire()
    assert str(locks) in info.value.message
    assert info.value.hint is not None and f"rm {locks}" in info.value.hint


def test_a_new_lock_file_gives_others_nothing(tmp_path):
    path = tmp_path / "usage.lock"
    previous = os.umask(0o002)
    try:
        with FileLock(path, timeout=1):
            pass
    finally:
        os.umask(previous)
    assert _mode(path) & 0o007 == 0


def test_a_private_lock_directory_is_closed_to_others(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o2775)
    previous = os.umask(0o002)
    try:
        with FileLock(root / ".locks" / "root.lock", timeout=1, private=True):
            pass
    finally:
        os.umask(previous)
    assert _mode(root / ".locks") & 0o007 == 0
    assert _mode(root / ".locks") & 0o070 == 0o070  # the maintainers' group keeps it
    assert _mode(root / ".locks" / "root.lock") & 0o007 == 0


def test_an_open_lock_directory_left_by_an_older_version_is_closed(tmp_path):
    locks = tmp_path / ".locks"
    locks.mkdir()
    os.chmod(locks, 0o2775)  # what older versions made under umask 002
    old = locks / "manifest.lock"
    old.write_text("")
    os.chmod(old, 0o664)
    with FileLock(old, timeout=1, private=True):
        pass
    assert _mode(locks) == 0o2770
    assert _mode(old) & 0o007 == 0


def test_a_personal_install_keeps_its_lock_directory_to_its_owner(tmp_path):
    # Not group-writable: the group does not maintain it, so it gets no access.
    locks = tmp_path / ".locks"
    locks.mkdir()
    os.chmod(locks, 0o755)
    with FileLock(locks / "root.lock", timeout=1, private=True):
        pass
    assert _mode(locks) == 0o700
    assert _mode(locks / "root.lock") & 0o077 == 0


def test_the_timeout_names_a_holder_in_this_process(tmp_path):
    path = tmp_path / "root.lock"
    with FileLock(path, timeout=5), pytest.raises(LockTimeout) as info:
        FileLock(path, timeout=0.1, what="install-root lock").acquire()
    assert f"pid {os.getpid()}" in info.value.message
    assert "this process" in info.value.message
