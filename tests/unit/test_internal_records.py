"""The small JSON records rootstock writes for itself are read strictly too.

An env's ``rootstock-env.json``, a lock directory's ``owner.json`` and a run
directory's ``owner.json`` can be truncated by a crash or written by a hostile
user of a shared filesystem. Any content reads as "no record" (the same as a
missing file), never as a ``RecursionError`` or ``AttributeError`` traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rootstock.install import locking
from rootstock.install.envs import ENV_METADATA, read_env_metadata
from rootstock.install.layout import InstallLayout
from rootstock.runtime import server

HOSTILE = {
    "deep-arrays": b"[" * 100_000,
    "deep-objects": b'{"a":' * 100_000,
    "nan": b'{"host": NaN, "pid": NaN}',
    "huge-number": b'{"pid": 1e999}',
    "a-list": b"[1, 2, 3]",
    "not-utf8": b"\xff\xfe{}",
    "pid-a-list": b'{"host": "%s", "pid": [1]}' % os.uname().nodename.encode(),
    "pid-inf": b'{"host": "%s", "pid": 1e308}' % os.uname().nodename.encode(),
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_env_metadata_that_cannot_be_read_is_no_metadata(tmp_path: Path, content: bytes):
    layout = InstallLayout(tmp_path, tmp_path)
    env_dir = layout.env_dir("emt")
    env_dir.mkdir(parents=True)
    (env_dir / ENV_METADATA).write_bytes(content)
    data = read_env_metadata(layout, "emt")
    assert data is None or isinstance(data, dict)


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_lock_owner_that_cannot_be_read_is_a_held_lock(tmp_path: Path, content: bytes):
    # No lock file to probe: the mkdir fallback's directory and its owner record decide.
    lock = tmp_path / "root.lock"
    lock_dir = tmp_path / "root.lock.d"
    lock_dir.mkdir()
    (lock_dir / "owner.json").write_bytes(content)
    assert locking.is_locked(lock) is True  # unreadable owner: never judged stale


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_run_dir_owner_that_cannot_be_read_is_left_alone(tmp_path: Path, content: bytes):
    run_dir = tmp_path / f"{server.RUN_DIR_PREFIX}hostile"
    run_dir.mkdir(mode=0o700)
    (run_dir / server.OWNER_FILE).write_bytes(content)
    assert server.sweep_dead_run_dirs(tmp_path) == []
    assert run_dir.is_dir()
