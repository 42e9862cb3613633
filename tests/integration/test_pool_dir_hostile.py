"""The pool commands and the calculator against a pool directory someone broke.

A FIFO, a symbolic link or a directory where a pooled worker's state, log or lock
file belongs: every command finishes (the old code hung on a FIFO forever) with a
message that names the path, what is there, and the ``rm`` that clears it. Every
command runs as a subprocess with a deadline, so a hang fails the test.

And the compiler-cache directory of last resort (``rootstock-cc-*``, made when
both ``~/.cache`` and ``$TMPDIR/rootstock-<uid>`` are unusable) does not outlive
the process that made it.

Real uv-built EMT env (the session's ``emt_root``), real daemons and workers. Each
test gets a private 0700 ``XDG_RUNTIME_DIR``; teardown stops every daemon in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rootstock.ops.workers import stop_workers
from rootstock.runtime.pool.directory import PoolFiles, ensure_pool_dir, read_states
from rootstock.runtime.spec import WorkerOptions, resolve_worker_spec
from rootstock.runtime.worker_keys import worker_key
from tests.conftest import run_rootstock

pytestmark = pytest.mark.timeout(600)

# A hang fails the command's subprocess.run, not the whole session.
DEADLINE_S = 120
WORDS = {"fifo": "a FIFO", "symlink": "a symbolic link", "directory": "a directory"}

CLIENT = textwrap.dedent(
    """
    import json, sys
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from rootstock import RootstockCalculator
    from rootstock.errors import RootstockError
    root, pool = sys.argv[1], sys.argv[2] == "pool"
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=0)
    try:
        with RootstockCalculator("emt", root=root, device="cpu", pool=pool) as calc:
            atoms.calc = calc
            energy = atoms.get_potential_energy()
            print(json.dumps({"pid": calc.worker_pid}), flush=True)
            if len(sys.argv) > 3:
                sys.stdin.readline()  # held open until the test kills us
    except RootstockError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": exc.message,
                          "hint": exc.hint}))
        sys.exit(3)
    ref = atoms.copy()
    ref.calc = EMT()
    assert abs(energy - ref.get_potential_energy()) < 1e-9
    """
)


@pytest.fixture
def pool(monkeypatch, tmp_path):
    """A private runtime dir and config; every daemon started in it is stopped."""
    runtime = Path(tempfile.mkdtemp(prefix="rs-hostile-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    for var in ("ROOTSTOCK_POOL", "ROOTSTOCK_WORKER_LOG", "ROOTSTOCK_ROOT"):
        monkeypatch.delenv(var, raising=False)
    directory = ensure_pool_dir()
    yield directory
    # What a test planted goes first: were it still a FIFO to the code under test, the
    # clean-up below would hang on it.
    for path in directory.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.is_symlink() or path.is_fifo():
            path.unlink(missing_ok=True)
    pids = set()
    with contextlib.suppress(Exception):
        for state in read_states(directory):
            pids.update(p for p in (state["daemon"]["pid"], state.get("worker_pid")) if p)
        stop_workers([], all_workers=True)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(runtime, ignore_errors=True)


def emt_files(directory: Path, root: Path) -> PoolFiles:
    spec = resolve_worker_spec("emt", WorkerOptions(root, device="cpu"))
    return PoolFiles(directory, worker_key(spec).digest)


def plant(path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        target = path.with_name(f"{path.name}.elsewhere")
        target.write_text("{}")
        path.symlink_to(target)
    else:
        path.mkdir()
    return path


def fix(path: Path, kind: str) -> str:
    return f"rm -r {path}" if kind == "directory" else f"rm {path}"


def client(root: Path, *, pool: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLIENT, str(root), "pool" if pool else "own"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        stdin=subprocess.DEVNULL,
    )


def cli(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_rootstock(*map(str, args), env=env, timeout=DEADLINE_S, check=False)


def assert_reported(proc: subprocess.CompletedProcess, path: Path, kind: str) -> None:
    assert f"{path}" in proc.stderr and WORDS[kind] in proc.stderr, proc.stderr
    assert fix(path, kind) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_hostile_state_file_stops_no_pool_command(emt_root, pool, kind):
    files = emt_files(pool, emt_root)
    plant(files.state, kind)

    listed = cli("workers", "list")
    assert listed.returncode == 0 and "no pooled workers" in listed.stdout
    assert_reported(listed, files.state, kind)

    stopped = cli("workers", "stop", "--all")
    assert stopped.returncode == 0
    assert_reported(stopped, files.state, kind)

    calc = client(emt_root)
    if kind == "directory":
        # Nothing can go on while a directory holds the name; nothing is removed.
        assert calc.returncode == 3, calc.stderr
        error = json.loads(calc.stdout.splitlines()[-1])
        assert str(files.state) in error["message"] and "a directory" in error["message"]
        assert fix(files.state, kind) in error["hint"]
        started = cli("workers", "start", "emt", "--root", emt_root, "--device", "cpu")
        assert started.returncode == 1, started.stderr
        assert "\nerror: " in f"\n{started.stderr}"  # after the progress lines
        assert_reported(started, files.state, kind)
        assert files.state.is_dir()
        return
    # Under the start lock, a link or a FIFO is a dead daemon's leftover: replaced.
    assert calc.returncode == 0, calc.stdout + calc.stderr
    assert_reported(calc, files.state, kind)
    stop_workers([], all_workers=True)
    plant(files.state, kind)
    started = cli("workers", "start", "emt", "--root", emt_root, "--device", "cpu")
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == files.digest
    assert_reported(started, files.state, kind)


@pytest.mark.parametrize(
    ("which", "kind"),
    [("log", "symlink"), ("log", "fifo"), ("log", "directory"), ("lock", "directory"),
     ("lock", "symlink"), ("lock", "fifo")],
)  # fmt: skip
def test_a_hostile_log_or_lock_is_a_clear_error(emt_root, pool, which, kind):
    files = emt_files(pool, emt_root)
    path = plant(getattr(files, which), kind)

    calc = client(emt_root)
    assert calc.returncode == 3, calc.stdout + calc.stderr
    error = json.loads(calc.stdout.splitlines()[-1])
    assert error["error"] == "PoolFileError"
    assert str(path) in error["message"] and WORDS[kind] in error["message"]
    assert fix(path, kind) in error["hint"]

    started = cli("workers", "start", "emt", "--root", emt_root, "--device", "cpu")
    assert started.returncode == 1
    assert "\nerror: " in f"\n{started.stderr}"  # after the progress lines
    assert_reported(started, path, kind)


# --- the compiler-cache directory of last resort -------------------------------------


@pytest.fixture
def broken_caches(tmp_path):
    """A child environment where ~/.cache and $TMPDIR/rootstock-<uid> are both unusable."""
    tmp = Path(tempfile.mkdtemp(prefix="rs-cc-", dir="/tmp"))
    (tmp / f"rootstock-{os.getuid()}").write_text("squatted\n")  # a file, not a dir
    home = tmp_path / "home-is-a-file"
    home.write_text("not a directory\n")
    env = {**os.environ, "TMPDIR": str(tmp), "HOME": str(home)}
    for var in ("XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "ROOTSTOCK_POOL", "ROOTSTOCK_WORKER_LOG"):
        env.pop(var, None)
    yield tmp, env
    shutil.rmtree(tmp, ignore_errors=True)


def cc_dirs(*bases: Path) -> set[Path]:
    return {p for base in bases for p in base.glob("rootstock-cc-*")}


def test_the_last_resort_compiler_cache_is_removed_when_its_process_exits(emt_root, broken_caches):
    tmp, env = broken_caches
    before = cc_dirs(Path("/tmp"))
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, str(emt_root), "own"],
        capture_output=True, text=True, timeout=DEADLINE_S, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The last resort was taken (the warning names it), and is gone with its process.
    assert "compiler caches go to" in proc.stderr and "rootstock-cc-" in proc.stderr
    assert cc_dirs(tmp) == set()
    assert cc_dirs(Path("/tmp")) <= before


def test_a_killed_processs_last_resort_cache_is_swept_by_the_next(emt_root, broken_caches):
    tmp, env = broken_caches
    with subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(emt_root), "own", "hold"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, start_new_session=True,
    ) as held:  # fmt: skip
        try:
            assert held.stdout is not None
            line = held.stdout.readline()  # the worker answered: its cache dir exists
            assert "pid" in line, held.communicate(timeout=DEADLINE_S)
            assert len(cc_dirs(tmp)) == 1
        finally:
            os.killpg(held.pid, signal.SIGKILL)
            held.communicate(timeout=DEADLINE_S)
    assert len(cc_dirs(tmp)) == 1  # nothing runs at exit under SIGKILL
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, str(emt_root), "own"],
        capture_output=True, text=True, timeout=DEADLINE_S, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cc_dirs(tmp) == set()
