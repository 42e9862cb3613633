"""The test suite's own machinery: run-wide shared builds and the leftovers check."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rootstock.runtime.server import owner_record, write_owner
from tests.leftovers import find_leftovers, remove_leftovers
from tests.run_cache import RUN_DIR_ENV, link_live_tree, shared_build

REPO = Path(__file__).resolve().parents[2]

# Each process asks for the same shared build; the build sleeps, so the others queue.
_BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.run_cache import shared_build

    def build(path: Path) -> None:
        path.mkdir()
        with open(path.parent / "builds.log", "a") as fh:
            fh.write(sys.argv[1] + "\\n")
        time.sleep(1.0)
        (path / "made-by").write_text(sys.argv[1])

    print(shared_build("thing", build))
    """
)


def test_processes_asking_at_once_share_one_build(tmp_path: Path):
    env = {**os.environ, RUN_DIR_ENV: str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILDER, f"p{i}"], env=env, stdout=subprocess.PIPE, text=True
        )
        for i in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert outputs == [str(tmp_path / "thing")] * 4
    builders = (tmp_path / "builds.log").read_text().split()
    assert len(builders) == 1
    assert (tmp_path / "thing" / "made-by").read_text() == builders[0]


def test_a_failed_build_is_tried_again_from_an_empty_path(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))

    def broken(path: Path) -> None:
        path.mkdir()
        (path / "half").write_text("")
        raise RuntimeError("uv failed")

    with pytest.raises(RuntimeError, match="uv failed"):
        shared_build("thing", broken)
    seen: list[list[str]] = []

    def good(path: Path) -> None:
        seen.append(sorted(p.name for p in path.parent.glob("thing/*")))
        path.mkdir()

    assert shared_build("thing", good) == tmp_path / "thing"
    assert seen == [[]]
    assert shared_build("thing", broken) == tmp_path / "thing"  # done: not built again


def test_leftovers_name_the_run_s_processes_and_run_dirs_and_remove_them(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "tmp" / "rootstock-123-abc").mkdir(parents=True)
    (run_dir / "tmp" / "pytest-of-me").mkdir()
    # The user's lasting directory (pool and compiler cache fallback) is no run dir.
    (run_dir / "tmp" / f"rootstock-{os.getuid()}").mkdir()
    # A leftover is no longer this process's descendant: the shell that started it
    # exits, and it is re-parented.
    started = subprocess.run(
        ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"],
        env={**os.environ, RUN_DIR_ENV: str(run_dir)},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    leftover = int(started.stdout)
    # A run dir whose owner lives is a leftover; one whose owner died is swept, as the
    # product's next maker of a run dir would (reported, not a failure).
    write_owner(run_dir / "tmp" / "rootstock-123-abc", owner_record(leftover))
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)
    swept = run_dir / "tmp" / f"rootstock-{dead.pid}-dead"
    swept.mkdir()
    write_owner(swept, owner_record(dead.pid))
    other = subprocess.Popen(
        ["sleep", "300"], env={**os.environ, RUN_DIR_ENV: str(tmp_path / "another-run")}
    )
    # A child of the checking process (and its run dir) ends with it: not a leftover.
    child = subprocess.Popen(["sleep", "300"], env={**os.environ, RUN_DIR_ENV: str(run_dir)})
    (run_dir / "tmp" / f"rootstock-{child.pid}-xyz").mkdir()
    try:
        found = find_leftovers(run_dir, run_dir / "tmp", [tmp_path], settle_s=0.5)
        assert [pid for pid, _ in found.processes] == [leftover]
        assert "sleep 300" in found.lines()[0]
        assert found.run_dirs == [run_dir / "tmp" / "rootstock-123-abc"]
        assert found.swept == [swept] and not swept.exists()
        assert found.mounts == []
        remove_leftovers(found)
        wait_gone(leftover)
        assert not (run_dir / "tmp" / "rootstock-123-abc").exists()
        assert (run_dir / "tmp" / f"rootstock-{os.getuid()}").is_dir()
        assert other.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leftover, signal.SIGKILL)
        for proc in (other, child):
            proc.kill()
            proc.wait(timeout=30)


def wait_gone(pid: int, deadline_s: float = 60.0) -> None:
    """Wait until ``pid`` is gone or a zombie (its new parent reaps it)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still alive {deadline_s} s after SIGKILL")


def test_stage_directories_left_in_the_run_or_a_test_dir_are_found_and_removed(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "tmp").mkdir(parents=True)
    in_run = run_dir / "tmp" / f".rootstock-stage-{os.getuid()}"
    in_test = tmp_path / "basetemp" / "popen-gw0" / "test_x0" / "stg" / ".rootstock-stage-0"
    for stage in (in_run, in_test):
        (stage / "emt.1-abc").mkdir(parents=True)
    found = find_leftovers(run_dir, run_dir / "tmp", [tmp_path / "basetemp"], settle_s=0.5)
    assert sorted(found.stages) == sorted([in_run, in_test])
    assert any(line == f"stage directory: {in_test}" for line in found.lines())
    remove_leftovers(found)
    assert not in_run.exists() and not in_test.exists()


def test_a_run_with_nothing_left_finds_nothing(tmp_path):
    (tmp_path / "tmp" / "pytest-of-me").mkdir(parents=True)
    assert not find_leftovers(tmp_path, tmp_path / "tmp", [tmp_path])


def test_a_live_cache_copy_links_files_and_gets_its_own_locks(tmp_path: Path, monkeypatch):
    source = tmp_path / "cache"
    (source / "archive" / "a").mkdir(parents=True)
    (source / "archive" / "a" / "f.py").write_text("x = 1\n")
    (source / "archive" / "gone.py").write_text("y = 2\n")
    (source / ".lock").write_text("")
    (source / ".tmpABC").mkdir()
    (source / ".tmpABC" / "partial").write_text("")
    (source / "link").symlink_to("archive/a")
    real_link = os.link

    def vanishing(src, dst, *args, **kwargs):
        # Another process removes this entry between the walk and the link.
        if Path(src).name == "gone.py":
            raise FileNotFoundError(src)
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", vanishing)
    target = tmp_path / "copy"
    link_live_tree(source, target)

    copied = target / "archive" / "a" / "f.py"
    assert copied.stat().st_ino == (source / "archive" / "a" / "f.py").stat().st_ino
    assert not (target / "archive" / "gone.py").exists()
    assert (target / ".lock").exists()
    assert (target / ".lock").stat().st_ino != (source / ".lock").stat().st_ino
    assert not (target / ".tmpABC").exists()
    assert os.readlink(target / "link") == "archive/a"
