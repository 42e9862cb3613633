"""No orphans: a worker (or in-env script) whose starter is SIGKILLed exits within 5 s.

Each client is a real subprocess running rootstock (RootstockCalculator, or
``spawn_worker`` itself); the test SIGKILLs the client alone, as the out-of-memory
killer or ``kill -9`` would, and watches the worker, which lives in a session of
its own and is told nothing but what its lifeline says.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.killing import is_running

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

GONE_WITHIN_S = 5.0


@pytest.fixture(autouse=True)
def private_tmpdir(monkeypatch):
    """The clients' run dirs go to a private $TMPDIR: a dead client's dir (read here
    after the kill) is out of reach of other processes' sweeps of /tmp."""
    base = Path(tempfile.mkdtemp(prefix="h6o-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.02)
    return not is_running(pid)


def read_lines(proc: subprocess.Popen, count: int, timeout: float) -> list[str]:
    """``count`` lines of the client's stdout, or fail (with its stderr) at the deadline."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(lines) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
    if len(lines) < count:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the client printed {lines!r}, then exited {proc.returncode}:\n{err}")
    return lines


@contextlib.contextmanager
def client(script: str):
    """Run ``script`` as the client; teardown kills it and any worker it named."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    spawned: list[int] = []
    try:
        yield proc, spawned
    finally:
        for pid in [proc.pid, *spawned]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def test_a_client_killed_mid_calculation_takes_its_worker_along(fake_built_root):
    script = f"""
        from ase.build import bulk
        from rootstock import RootstockCalculator
        calc = RootstockCalculator(root={str(fake_built_root)!r}, checkpoint="charge-emt",
                                   device="cpu")
        atoms = bulk("Cu", cubic=True)
        atoms.calc = calc
        atoms.get_potential_energy()
        print(calc.worker_pid, calc._session._listener.run_dir, flush=True)
        atoms.info["sleep"] = 300  # the model is busy for minutes
        atoms.get_potential_energy()
        """
    with client(script) as (proc, spawned):
        worker, run_dir = read_lines(proc, 1, 90)[0].split()
        spawned.append(int(worker))
        time.sleep(1.0)  # well inside the model's sleep
        assert is_running(int(worker))
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_gone(int(worker), GONE_WITHIN_S), "the worker outlived its client"
        log = (Path(run_dir) / "worker.log").read_text()
        assert "the process that started this worker is gone" in log


def test_a_client_killed_before_its_worker_connects_leaves_no_worker(fake_built_root, tmp_path):
    # The starter dies at once, long before the worker's first look at its parent:
    # a getppid() check then sees init from the start and never notices.
    script = f"""
        import os, signal
        from rootstock.install.machine import resolve_layout
        from rootstock.runtime.spawn import spawn_worker
        from rootstock.runtime.spec import WorkerSpec
        layout = resolve_layout({str(fake_built_root)!r}, None, None)
        spec = WorkerSpec(layout, "emt", "emt", device="cpu")
        worker = spawn_worker(spec,
                              socket_path={str(tmp_path / "nobody-listens.sock")!r},
                              output={str(tmp_path / "worker.log")!r}, connect_timeout=120)
        print(worker.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    with client(script) as (proc, spawned):
        worker = int(read_lines(proc, 1, 60)[0])
        spawned.append(worker)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert wait_gone(worker, GONE_WITHIN_S), "the worker kept retrying its connect"
    assert "the process that started this worker is gone" in (tmp_path / "worker.log").read_text()


def test_a_closed_calculator_still_ends_its_worker_cleanly(fake_built_root):
    # The lifeline is cut only after the grace period: EXIT still means status 0.
    from rootstock import RootstockCalculator

    calc = RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu")
    try:
        from ase.build import bulk

        atoms = bulk("Cu", cubic=True)
        atoms.calc = calc
        atoms.get_potential_energy()
        process = calc._session.process
    finally:
        calc.close()
    assert process.returncode == 0
    assert process.lifeline is None


def test_a_script_run_by_the_lifeline_runner_dies_with_its_starter(tmp_path):
    # rootstock benchmark's in-env probe runs this way; the runner is stdlib only.
    target = tmp_path / "sleeper.py"
    marker = tmp_path / "argv.txt"
    target.write_text(
        "import sys, time\n"
        f"open({str(marker)!r}, 'w').write(' '.join(sys.argv[1:]) + ' ' + __name__)\n"
        "time.sleep(300)\n"
    )
    script = f"""
        import os, signal, subprocess, sys, time
        from rootstock.wire.lifeline import Lifeline, script_command
        lifeline = Lifeline()
        child = subprocess.Popen(
            script_command(sys.executable, lifeline.child_fd, {str(target)!r}, ["a", "b"]),
            pass_fds=(lifeline.child_fd,), start_new_session=True,
            stderr=open({str(tmp_path / "runner.log")!r}, "w"))
        lifeline.child_started()
        print(child.pid, flush=True)
        while not os.path.exists({str(marker)!r}):
            time.sleep(0.02)
        print("running", flush=True)
        time.sleep(300)
        """
    with client(script) as (proc, spawned):
        runner = int(read_lines(proc, 1, 120)[0])
        spawned.append(runner)
        assert read_lines(proc, 1, 120) == ["running"]
        assert marker.read_text() == "a b __main__"
        os.kill(proc.pid, signal.SIGKILL)
        assert wait_gone(runner, GONE_WITHIN_S), "the script outlived its starter"
    assert "the process that started it is gone" in (tmp_path / "runner.log").read_text()


def test_the_lifeline_runner_passes_the_scripts_exit_status_on(tmp_path):
    from rootstock.wire.lifeline import STARTER_GONE_EXIT, Lifeline, script_command

    target = tmp_path / "exits.py"
    target.write_text("import sys\nsys.exit(7)\n")

    lifeline = Lifeline()
    try:
        proc = subprocess.run(
            script_command(sys.executable, lifeline.child_fd, str(target), []),
            pass_fds=(lifeline.child_fd,),
            timeout=60,
        )
    finally:
        lifeline.close()
    assert proc.returncode == 7 != STARTER_GONE_EXIT
