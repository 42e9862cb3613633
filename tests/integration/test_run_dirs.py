"""No leftovers from the private directories a spawn makes.

* Run directories (socket, worker.log): each records its owner; a new one sweeps
  the same user's run directories whose owner is gone, on this host only.
* The compiler-cache fallback: one per user, used only when it is ours and 0700.

Run directories go to a private ``$TMPDIR`` per test (``XDG_RUNTIME_DIR`` unset),
so no other test's, or engineer's, directories are ever in reach of a sweep.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.runtime import server, worker_env

pytestmark = pytest.mark.timeout(600)

NOBODY = 65534
# The documented name of the owner record (docs/worker-environment.md).
OWNER_FILE = "owner.json"


@pytest.fixture
def tmpdir_base(monkeypatch) -> Path:
    """A short, private temp dir standing in for ``$TMPDIR`` (for us and our children)."""
    base = Path(tempfile.mkdtemp(prefix="h6-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    subprocess.run(["rm", "-rf", str(base)], check=False, timeout=60)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=30)
    return proc.pid


def fake_run_dir(base: Path, name: str, record: object) -> Path:
    path = base / f"rootstock-{name}"
    path.mkdir(mode=0o700)
    (path / OWNER_FILE).write_text(json.dumps(record))
    (path / "worker.log").write_text("what the worker said\n")
    return path


# --- run directories ---------------------------------------------------------------------


def test_a_run_dir_records_its_owner(tmpdir_base):
    run_dir = server.make_private_dir()
    record = json.loads((run_dir / OWNER_FILE).read_text())
    assert run_dir.parent == tmpdir_base
    assert record["host"] == socket.gethostname()
    assert record["pid"] == os.getpid()
    assert record["started"]  # the pid's start time, against pid reuse
    assert stat.S_IMODE((run_dir / OWNER_FILE).stat().st_mode) == 0o600
    assert not server.owner_is_gone(record)


@pytest.mark.usefixtures("runtime_isolation")
def test_a_killed_clients_run_dir_is_swept_by_the_next_calculator(tmpdir_base, fake_built_root):
    from ase.build import bulk

    from rootstock import RootstockCalculator

    script = f"""
        import os, signal
        from ase.build import bulk
        from rootstock import RootstockCalculator
        calc = RootstockCalculator(root={str(fake_built_root)!r}, checkpoint="emt", device="cpu")
        atoms = bulk("Cu", cubic=True)
        atoms.calc = calc
        atoms.get_potential_energy()
        print(calc._session._listener.run_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left_behind = Path(proc.stdout.split()[0])
    assert left_behind.parent == tmpdir_base
    assert left_behind.is_dir()  # a SIGKILL cleans nothing up

    other_host = fake_run_dir(tmpdir_base, "othernode", {"host": "node-b", "pid": dead_pid()})
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        atoms = bulk("Cu", cubic=True)
        atoms.calc = calc
        atoms.get_potential_energy()
        mine = calc._session._listener.run_dir
        assert not left_behind.exists(), "the dead client's run dir survived the next spawn"
        assert other_host.exists(), "another host's run dir was swept"
    assert not mine.exists()


def test_the_sweep_removes_only_dead_owners_of_this_host(tmpdir_base, tmp_path):
    here = socket.gethostname()
    me = server.owner_record()
    dead = fake_run_dir(tmpdir_base, "dead", {"host": here, "pid": dead_pid()})
    reused = fake_run_dir(tmpdir_base, "reused", {**me, "started": "1"})  # pid reused since
    rebooted = fake_run_dir(tmpdir_base, "rebooted", {**me, "boot": "an-earlier-boot"})
    alive = fake_run_dir(tmpdir_base, "alive", me)
    elsewhere = fake_run_dir(tmpdir_base, "elsewhere", {"host": f"{here}-b", "pid": dead_pid()})
    garbled = fake_run_dir(tmpdir_base, "garbled", {"host": here})
    unreadable = tmpdir_base / "rootstock-oldstyle"  # no owner file: an older rootstock's
    unreadable.mkdir()
    # No owner record and two days old: its maker died between mkdtemp and the record.
    abandoned = tmpdir_base / "rootstock-abandoned"
    abandoned.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(abandoned, (two_days_ago, two_days_ago))
    not_ours = fake_run_dir(tmpdir_base, "notours", {"host": here, "pid": dead_pid()})
    os.chown(not_ours, NOBODY, NOBODY)
    target = fake_run_dir(tmp_path, "target", {"host": here, "pid": dead_pid()})
    link = tmpdir_base / "rootstock-link"
    link.symlink_to(target)
    removed = server.sweep_dead_run_dirs(tmpdir_base)
    assert sorted(removed) == sorted([dead, reused, rebooted, abandoned])
    for kept in (alive, elsewhere, garbled, unreadable, not_ours, link, target):
        assert kept.exists(), kept


def test_a_run_dir_whose_maker_died_before_its_record_is_judged_by_the_pid_in_its_name(
    tmpdir_base,
):
    # Killed between mkdtemp and owner.json: no record, but the name carries the pid.
    a_minute_ago = time.time() - 60
    dead = tmpdir_base / f"rootstock-{dead_pid()}-abcd1234"
    alive = tmpdir_base / f"rootstock-fetch-{os.getpid()}-abcd1234"
    # A pid that started after the directory was made is a reuse, not its maker.
    reused = tmpdir_base / f"rootstock-{os.getpid()}-efgh5678"
    fresh = tmpdir_base / f"rootstock-{dead_pid()}-ijkl9012"  # mkdtemp a moment ago
    untagged = tmpdir_base / "rootstock-mnop3456"  # an older rootstock's name
    for path in (dead, alive, reused, fresh, untagged):
        path.mkdir(mode=0o700)
    for path in (dead, untagged):
        os.utime(path, (a_minute_ago, a_minute_ago))
    # Made after this process started (which may be moments ago, run on its own).
    since_start = max(time.time() - 5, server.process_start_time(os.getpid()) + 2)
    os.utime(alive, (since_start, since_start))
    before_we_started = server.process_start_time(os.getpid()) - 30
    os.utime(reused, (before_we_started, before_we_started))
    assert sorted(server.sweep_dead_run_dirs(tmpdir_base)) == sorted([dead, reused])
    for kept in (alive, fresh, untagged):
        assert kept.is_dir(), kept


def test_the_users_lasting_directory_is_never_swept(tmpdir_base):
    # /tmp/rootstock-<uid> holds the pool and the compiler-cache fallback: no owner
    # record, and days old when no daemon has run for a while.
    lasting = tmpdir_base / f"rootstock-{os.getuid()}"
    old_untagged = tmpdir_base / "rootstock-qrst7890"
    for path in (lasting, old_untagged):
        path.mkdir(mode=0o700)
        two_days_ago = time.time() - 2 * 86400
        os.utime(path, (two_days_ago, two_days_ago))
    assert server.sweep_dead_run_dirs(tmpdir_base) == [old_untagged]
    assert lasting.is_dir()


def test_a_run_dir_is_named_for_its_maker(tmpdir_base):
    run_dir = server.make_private_dir("rootstock-fetch-")
    assert run_dir.name.startswith(f"rootstock-fetch-{os.getpid()}-")
    assert len(run_dir.name) == len(f"rootstock-fetch-{os.getpid()}-") + 8


def test_a_run_dir_swept_by_another_process_mid_sweep_is_skipped(tmpdir_base, monkeypatch):
    # Two starters sweep at once: a name listed by one is gone by the time it looks.
    dead = fake_run_dir(tmpdir_base, "dead", {"host": socket.gethostname(), "pid": dead_pid()})
    listdir = os.listdir
    monkeypatch.setattr(server.os, "listdir", lambda p: ["rootstock-vanished", *listdir(p)])
    assert server.sweep_dead_run_dirs(tmpdir_base) == [dead]


def test_the_sweep_never_judges_another_hosts_owner():
    assert not server.owner_is_gone({"host": "node-b", "pid": dead_pid()})
    assert not server.owner_is_gone({"host": "node-b", "pid": os.getpid(), "boot": "x"})
    for garbage in (None, [], "x", {"pid": dead_pid()}, {"host": socket.gethostname()}):
        assert not server.owner_is_gone(garbage)
    assert server.owner_is_gone({"host": socket.gethostname(), "pid": dead_pid()})


# --- the compiler-cache fallback ---------------------------------------------------------


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    return InstallLayout(tmp_path / "root", tmp_path / "cache-root")


@pytest.fixture
def unusable_home(tmp_path: Path) -> dict[str, str]:
    """A HOME nobody can make ~/.cache/rootstock in, root included (.cache is a file)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("not a directory\n")
    return {"HOME": str(home)}


@pytest.fixture
def fresh_last_resort(monkeypatch):
    monkeypatch.setattr(worker_env, "_last_resort_cache", None)


def cc_dirs(base: Path) -> list[Path]:
    return sorted(base.glob("rootstock-cc-*"))


@pytest.mark.usefixtures("fresh_last_resort")
def test_an_unusable_home_gets_one_fallback_per_user(tmpdir_base, layout, unusable_home):
    chosen = {worker_env.compiler_cache_dir(unusable_home, layout) for _ in range(3)}
    assert chosen == {tmpdir_base / f"rootstock-{os.getuid()}"}
    assert stat.S_IMODE(next(iter(chosen)).stat().st_mode) == 0o700
    assert cc_dirs(tmpdir_base) == []


@pytest.mark.usefixtures("fresh_last_resort")
def test_a_home_cache_owned_by_someone_else_is_not_used(tmpdir_base, layout, tmp_path):
    # As root, os.access says yes to anybody's directory: ownership must decide.
    home = tmp_path / "someone"
    (home / ".cache" / "rootstock").mkdir(parents=True)
    os.chown(home / ".cache" / "rootstock", NOBODY, NOBODY)
    chosen = worker_env.compiler_cache_dir({"HOME": str(home)}, layout)
    assert chosen == tmpdir_base / f"rootstock-{os.getuid()}"


@pytest.mark.usefixtures("fresh_last_resort")
def test_a_symlinked_home_cache_is_not_followed(tmpdir_base, layout, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    (home / ".cache" / "rootstock").symlink_to(elsewhere)
    chosen = worker_env.compiler_cache_dir({"HOME": str(home)}, layout)
    assert chosen == tmpdir_base / f"rootstock-{os.getuid()}"


@pytest.mark.usefixtures("fresh_last_resort")
def test_a_fallback_of_ours_that_others_can_read_is_made_0700(tmpdir_base, layout, unusable_home):
    fallback = tmpdir_base / f"rootstock-{os.getuid()}"
    fallback.mkdir()
    fallback.chmod(0o755)
    assert worker_env.compiler_cache_dir(unusable_home, layout) == fallback
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700


@pytest.mark.usefixtures("fresh_last_resort")
@pytest.mark.parametrize("squat", ["other-owner", "world-writable", "symlink"])
def test_a_squatted_fallback_gives_one_fresh_private_dir_per_process(
    tmpdir_base, layout, unusable_home, tmp_path, squat
):
    fallback = tmpdir_base / f"rootstock-{os.getuid()}"
    if squat == "symlink":
        (tmp_path / "planted").mkdir(mode=0o700)
        fallback.symlink_to(tmp_path / "planted")
    else:
        fallback.mkdir()
        if squat == "other-owner":
            os.chown(fallback, NOBODY, NOBODY)
        else:
            fallback.chmod(0o777)
    first = worker_env.compiler_cache_dir(unusable_home, layout)
    again = worker_env.compiler_cache_dir(unusable_home, layout)
    assert first == again, "every spawn made a new cache dir"
    assert first != fallback and first.parent == tmpdir_base
    assert first.name.startswith("rootstock-cc-")
    st = os.lstat(first)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert cc_dirs(tmpdir_base) == [first]


def test_a_read_only_home_for_a_real_user_falls_back(tmp_path):
    """As a real unprivileged user (nobody), where permission bits do apply."""
    if os.getuid() != 0:
        pytest.skip("needs root to become another user")
    base = Path(tempfile.mkdtemp(prefix="h6-nobody-", dir="/tmp"))
    try:
        base.chmod(0o755)
        home = base / "home"
        home.mkdir(mode=0o555)
        tmp = base / "tmp"
        tmp.mkdir()
        os.chown(tmp, NOBODY, NOBODY)
        code = textwrap.dedent(
            f"""
            import tempfile
            from pathlib import Path
            from rootstock.install.layout import InstallLayout
            from rootstock.runtime import worker_env
            layout = InstallLayout(Path("/nonexistent/root"), Path("/nonexistent/cache"))
            tempfile.tempdir = {str(tmp)!r}
            print(worker_env.compiler_cache_dir({{"HOME": {str(home)!r}}}, layout))
            print(worker_env.compiler_cache_dir({{"HOME": {str(home)!r}}}, layout))
            """
        )
        src = Path(worker_env.__file__).resolve().parents[2]
        proc = subprocess.run(
            [
                "setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                sys.executable,
                "-I",
                "-c",
                f"import sys; sys.path.insert(0, {str(src)!r})\n" + code,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0 and "setpriv" in proc.stderr:
            pytest.skip(f"cannot switch user here: {proc.stderr.strip()}")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [str(tmp / f"rootstock-{NOBODY}")] * 2
        assert not list(tmp.glob("rootstock-cc-*"))
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False, timeout=60)
