"""Whether generation locks can be trusted, read from a mount table; and what
``install`` deletes of an env's old generations when they can, and when they cannot.

The mount tables are fake ``/proc/self/mountinfo`` files (``MOUNTINFO`` points at
them), so each filesystem a cluster might put the install on is checked here on
any machine. A lock *held* by a worker needs a second process (``lockf`` locks are
per process), so that case lives in tests/integration/test_generation_locks.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rootstock.install import generations
from rootstock.install.generations import (
    GENERATION_LOCK,
    INCOHERENT_LOCKS_KEEP_S,
    claim_generation,
    locks_are_coherent,
    make_generation_lock,
    remove_old_generations,
)
from rootstock.worker.main import generation_in_maps

pytestmark = pytest.mark.timeout(60)

ROOT_EXT4 = "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro"
INSTALL = Path("/lus/eagle/projects/rootstock/envs")


def mountinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    table = tmp_path / "mountinfo"
    table.write_text("\n".join((ROOT_EXT4, *lines)) + "\n")
    monkeypatch.setattr(generations, "MOUNTINFO", table)


# id -> (the mount line for /lus/eagle, coherent?, fstype, a word of the reason)
MOUNTS = {
    "ext4": (
        "40 22 259:3 / /lus/eagle rw,relatime shared:2 - ext4 /dev/nvme1n1 rw",
        True,
        "ext4",
        "local",
    ),
    "nfs4 with a lock manager": (
        "41 22 0:50 / /lus/eagle rw,relatime shared:3 - nfs4 srv:/export "
        "rw,vers=4.2,rsize=1048576,hard,proto=tcp,local_lock=none,addr=10.0.0.1",
        True,
        "nfs4",
        "server-side",
    ),
    "nfs nolock": (
        "42 22 0:51 / /lus/eagle rw,relatime shared:4 - nfs srv:/export "
        "rw,vers=3,nolock,proto=tcp,local_lock=all,addr=10.0.0.1",
        False,
        "nfs",
        "local",
    ),
    "nfs4 local_lock=posix": (
        "43 22 0:52 / /lus/eagle rw shared:5 - nfs4 srv:/export rw,vers=4.1,local_lock=posix",
        False,
        "nfs4",
        "local_lock=posix",
    ),
    "lustre flock": (
        "44 22 0:53 / /lus/eagle rw,flock,lazystatfs shared:6 - lustre 10.0.0.2@o2ib:/eagle "
        "rw,flock,lazystatfs",
        True,
        "lustre",
        "cluster-wide",
    ),
    "lustre localflock": (
        "45 22 0:54 / /lus/eagle rw,localflock,lazystatfs shared:7 - lustre 10.0.0.2@o2ib:/eagle "
        "rw,localflock,lazystatfs",
        False,
        "lustre",
        "node-local",
    ),
    "lustre without flock": (
        "46 22 0:55 / /lus/eagle rw,lazystatfs shared:8 - lustre 10.0.0.2@o2ib:/eagle rw",
        False,
        "lustre",
        "node-local",
    ),
    "gpfs": ("47 22 0:56 / /lus/eagle rw,relatime shared:9 - gpfs eagle rw", True, "gpfs", "wide"),
    "fuse.sshfs": (
        "48 22 0:57 / /lus/eagle rw,nosuid,nodev shared:10 - fuse.sshfs me@login:/x "
        "rw,user_id=1000,group_id=1000",
        False,
        "fuse.sshfs",
        "not known",
    ),
}


@pytest.mark.parametrize(("line", "coherent", "fstype", "word"), MOUNTS.values(), ids=MOUNTS)
def test_each_filesystem_is_judged_by_its_type_and_options(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    line: str,
    coherent: bool,
    fstype: str,
    word: str,
) -> None:
    mountinfo(tmp_path, monkeypatch, line)
    found = locks_are_coherent(INSTALL)
    assert (found.coherent, found.fstype) == (coherent, fstype)
    assert word in found.reason


def test_the_longest_mount_point_above_the_path_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mountinfo(
        tmp_path,
        monkeypatch,
        MOUNTS["lustre localflock"][0].replace("/lus/eagle", "/lus", 1),
        MOUNTS["ext4"][0].replace("/lus/eagle", "/lus/eagle/projects", 1),
        # A sibling whose name the path merely starts with is no mount above it.
        MOUNTS["fuse.sshfs"][0].replace("/lus/eagle", "/lus/eagle/proj", 1),
    )
    assert locks_are_coherent(INSTALL).fstype == "ext4"
    assert locks_are_coherent(Path("/lus/other/envs")).fstype == "lustre"
    assert locks_are_coherent(Path("/home/me/envs")).fstype == "ext4"


def test_escaped_mount_points_and_junk_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mountinfo(
        tmp_path,
        monkeypatch,
        "not a mountinfo line",
        "1 2 - short",
        "49 22 0:58 / /scratch\\040space rw shared:11 - nfs srv:/s rw,nolock",
    )
    found = locks_are_coherent(Path("/scratch space/envs"))
    assert (found.coherent, found.fstype) == (False, "nfs")
    assert locks_are_coherent(Path("/scratch/envs")).fstype == "ext4"


def test_no_mount_table_is_taken_as_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generations, "MOUNTINFO", tmp_path / "absent")
    found = locks_are_coherent(INSTALL)
    assert (found.coherent, found.fstype) == (True, "unknown")


def test_this_machine_reads_its_own_table() -> None:
    found = locks_are_coherent(Path(__file__))
    assert found.fstype != "unknown"  # /proc/self/mountinfo exists on Linux
    assert found.reason


# --- removing old generations ------------------------------------------------------


def generation(envs: Path, build_id: str, *, age_s: float, lock: bool = True) -> Path:
    """``envs/.emt.<build_id>/`` with a file in it, its mtime ``age_s`` in the past."""
    path = envs / f".emt.{build_id}"
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    if lock:
        make_generation_lock(path)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_the_lock_file_is_group_writable_and_world_readable_whatever_the_umask(
    tmp_path: Path,
) -> None:
    old = os.umask(0o077)
    try:
        make_generation_lock(tmp_path)
    finally:
        os.umask(old)
    lock = tmp_path / GENERATION_LOCK
    assert lock.stat().st_mode & 0o777 == 0o664
    assert lock.read_bytes() == b""


def test_free_and_pre_lock_generations_go_kept_ones_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mountinfo(tmp_path, monkeypatch)  # everything on ext4: locks are coherent
    envs = tmp_path / "envs"
    legacy = generation(envs, "legacy", age_s=400, lock=False)
    free = generation(envs, "aaaa", age_s=300)
    previous = generation(envs, "bbbb", age_s=200)
    current = generation(envs, "cccc", age_s=100)
    warnings = remove_old_generations([legacy, free, previous, current], {current, previous})
    assert warnings == []
    assert not legacy.exists() and not free.exists()
    assert previous.is_dir() and current.is_dir()


def test_a_generation_that_cannot_be_claimed_is_kept_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mountinfo(tmp_path, monkeypatch)
    envs = tmp_path / "envs"
    old = generation(envs, "aaaa", age_s=300)
    current = generation(envs, "cccc", age_s=100)
    # A lock file we cannot open for writing (here: a directory in its place) is
    # never taken as free.
    (old / GENERATION_LOCK).unlink()
    (old / GENERATION_LOCK).mkdir()
    with claim_generation(old) as claimed:
        assert claimed is False
    warnings = remove_old_generations([old, current], {current})
    assert old.is_dir()
    assert len(warnings) == 1 and str(old) in warnings[0] and "running worker" in warnings[0]


def test_incoherent_locks_keep_what_was_replaced_within_a_day(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mountinfo(tmp_path, monkeypatch, "50 22 0:59 / / rw shared:12 - lustre mgs:/fs rw,localflock")
    envs = tmp_path / "envs"
    day = INCOHERENT_LOCKS_KEEP_S
    ancient = generation(envs, "aaaa", age_s=3 * day)
    # Built two days ago but replaced (by "cccc") only an hour ago: still in use, maybe.
    replaced_lately = generation(envs, "bbbb", age_s=2 * day)
    recent = generation(envs, "cccc", age_s=3600)
    previous = generation(envs, "dddd", age_s=60)
    current = generation(envs, "eeee", age_s=1)
    gens = [ancient, replaced_lately, recent, previous, current]
    warnings = remove_old_generations(gens, {current, previous})
    # "aaaa" was replaced by "bbbb" two days ago: gone.
    assert not ancient.exists()
    assert replaced_lately.is_dir() and recent.is_dir()
    assert len(warnings) == 1
    assert ".emt.bbbb" in warnings[0] and ".emt.cccc" in warnings[0]
    assert "node-local" in warnings[0]


def test_nothing_to_remove(tmp_path: Path) -> None:
    assert remove_old_generations([], set()) == []


# --- which generation a worker holds --------------------------------------------------

MAPS = """\
7f3a1c000000-7f3a1c021000 rw-p 00000000 00:00 0
7f3a1d200000-7f3a1d400000 r-xp 00000000 fe:00 41 /opt/python/lib/libpython3.11.so.1.0
7f3a1e000000-7f3a1e100000 r-xp 00000000 fe:00 42 {envs}/.emt.foo.99/lib/x.so
7f3a1e100000-7f3a1e200000 r-xp 0 fe:00 43 {envs}/.emt.{old}/lib/site-packages/np/_umath.so
7f3a1f000000-7f3a1f001000 r--p 00000000 00:00 0 [vdso]
"""


def test_the_worker_holds_the_generation_its_modules_came_from() -> None:
    envs = "/lus/root/envs"
    maps = MAPS.format(envs=envs, old="a1b2c3")
    # envs/emt already points at a newer build; the mapped numpy says where we run from.
    assert generation_in_maps(f"{envs}/.emt.d4e5f6", maps) == f"{envs}/.emt.a1b2c3"
    # Nothing mapped from this env, a legacy env, a plain venv: no answer.
    assert generation_in_maps(f"{envs}/.mace.d4e5f6", maps) is None
    assert generation_in_maps(f"{envs}/emt", maps) is None
    assert generation_in_maps("/home/me/venv", maps) is None
    assert generation_in_maps(f"{envs}/.emt.d4e5f6", "") is None
