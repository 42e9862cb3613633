"""The worker process: death and recovery, errors, output, hotfixes, environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import rootstock
from rootstock import RootstockCalculator
from rootstock.errors import WorkerError, WorkerTimeout
from tests.integration.killing import is_running
from tests.integration.structures import cu, emt_energy

from .conftest import SAMPLE_EMT, build_fake_root

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(180)]


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.05)
    return False


def test_kill_9_mid_calculation_raises_worker_died_then_recovers(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(root=fake_built_root, checkpoint="charge-emt", device="cpu") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        pid = calc.worker_pid
        atoms.info["sleep"] = 60  # the model stalls; we kill it while it computes
        killer = threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        with pytest.raises(rootstock.WorkerDiedError) as caught:
            atoms.get_potential_energy()
        killer.join()
        assert time.monotonic() - started < 30
        err = caught.value
        assert err.worker_exit_code == -signal.SIGKILL
        assert "SIGKILL" in str(err)
        assert calc.worker_pid is None
        del atoms.info["sleep"]
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        assert calc.worker_pid not in (None, pid)


def test_worker_died_carries_the_output_tail(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(root=fake_built_root, checkpoint="noisy", device="cpu") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        os.kill(calc.worker_pid, signal.SIGKILL)
        atoms.positions[0] += 0.1
        with pytest.raises(rootstock.WorkerDiedError) as caught:
            atoms.get_potential_energy()
        assert "x" * 100 in caught.value.output_tail


def test_a_worker_that_prints_megabytes_does_not_hang(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(
        root=fake_built_root, checkpoint="noisy", device="cpu", timeout=60
    ) as calc:
        atoms.calc = calc
        for step in range(4):  # 1 MB at setup, then 128 KB per calculation
            atoms.positions[0, 0] += 0.01 * step
            assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)


def test_worker_log_can_go_to_a_file(fake_built_root, tmp_path, monkeypatch):
    log = tmp_path / "worker.log"
    monkeypatch.setenv("ROOTSTOCK_WORKER_LOG", str(log))
    atoms = cu(2)
    with RootstockCalculator(root=fake_built_root, checkpoint="noisy", device="cpu") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
    assert log.stat().st_size > 1_000_000


@pytest.mark.parametrize("target", ["stderr", "stdout"])
def test_worker_log_to_a_standard_stream(fake_built_root, target, tmp_path):
    script = textwrap.dedent(
        f"""
        from ase.build import bulk
        from rootstock import RootstockCalculator
        atoms = bulk("Cu", cubic=True)
        with RootstockCalculator(root={str(fake_built_root)!r}, checkpoint="broken-setup",
                                 device="cpu") as calc:
            atoms.calc = calc
            try:
                atoms.get_potential_energy()
            except Exception:
                pass
        """
    )
    env = {**os.environ, "ROOTSTOCK_WORKER_LOG": target}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    stream = proc.stderr if target == "stderr" else proc.stdout
    assert "broken on purpose" in stream


def test_setup_error_comes_back_with_the_worker_traceback(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(root=fake_built_root, checkpoint="broken-setup", device="cpu") as calc:
        atoms.calc = calc
        with pytest.raises(WorkerError) as caught:
            atoms.get_potential_energy()
        err = caught.value
        assert not isinstance(err, rootstock.WorkerDiedError)
        assert "broken on purpose" in str(err)
        assert "setup()" in err.message
        assert "RuntimeError" in err.remote_traceback
        assert "env_source.py" in err.remote_traceback
        assert calc.worker_pid is None
        with pytest.raises(WorkerError, match="broken on purpose"):
            atoms.get_potential_energy()  # a fresh worker, the same clear error


def test_model_error_during_a_calculation_keeps_the_worker(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(root=fake_built_root, checkpoint="charge-emt", device="cpu") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        pid = calc.worker_pid
        atoms.info["fail"] = "this geometry is unsupported"
        with pytest.raises(WorkerError, match="unsupported") as caught:
            atoms.get_potential_energy()
        assert "ValueError" in caught.value.remote_traceback
        del atoms.info["fail"]
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        assert calc.worker_pid == pid


def test_hotfix_of_env_source_is_picked_up_at_the_next_spawn(own_root):
    atoms = cu(2)
    plain = emt_energy(atoms)
    with RootstockCalculator(root=own_root, checkpoint="emt", device="cpu") as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(plain, abs=1e-10)
    source = own_root / "envs" / "emt" / "env_source.py"
    original = source.read_text()
    hotfixed = original.replace(
        "    return EMT(**kw)",
        "    calc = EMT(**kw)\n"
        "    calc.calculate = _shifted(calc.calculate, calc)\n"
        "    return calc\n\n\n"
        "def _shifted(inner, calc):\n"
        "    def calculate(*args, **kwargs):\n"
        "        inner(*args, **kwargs)\n"
        "        calc.results['energy'] += 1.25\n"
        "    return calculate",
    )
    assert hotfixed != original
    # The supported procedure: edit a copy, then move it into place.
    staged = source.with_suffix(".new")
    staged.write_text(hotfixed)
    os.replace(staged, source)
    with RootstockCalculator(root=own_root, checkpoint="emt", device="cpu") as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(plain + 1.25, abs=1e-10)


def test_worker_environment_and_setup_kwargs(fake_built_root, tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("  hf_from_file \n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("PYTHONPATH", "/should/not/leak")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "pycache"))
    dump = tmp_path / "report.json"
    with RootstockCalculator(
        root=fake_built_root,
        checkpoint="probe",
        device="cpu",
        setup_kwargs={"dump": str(dump), "answer": 42, "tags": ["a", "b"]},
    ) as calc:
        atoms = cu(2)
        atoms.calc = calc
        atoms.get_potential_energy()
    report = json.loads(dump.read_text())
    env = report["env"]
    assert report["device"] == "cpu"
    assert report["kwargs"] == {"answer": 42, "tags": ["a", "b"]}
    assert env["HOME"] == str(fake_built_root / "home")
    assert env["XDG_CACHE_HOME"] == str(fake_built_root / "cache")
    assert env["HF_HOME"] == str(fake_built_root / "cache" / "huggingface")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["HF_TOKEN"] == env["HUGGING_FACE_HUB_TOKEN"] == "hf_from_file"
    assert env["PYTHONPATH"] is None
    assert env["PYTHONNOUSERSITE"] == "1"
    assert env["PYTHONPYCACHEPREFIX"] is None
    assert report["pycache_prefix"] is None
    assert not report["dont_write_bytecode"]
    assert report["no_user_site"] and report["isolated"]
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert not Path(env[var]).is_relative_to(fake_built_root)


def test_the_worker_exits_when_the_user_process_dies(fake_built_root, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from ase.build import bulk
        from rootstock import RootstockCalculator
        calc = RootstockCalculator(root={str(fake_built_root)!r}, checkpoint="emt",
                                   device="cpu")
        atoms = bulk("Cu", cubic=True)
        atoms.calc = calc
        atoms.get_potential_energy()
        print(calc.worker_pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    worker = int(proc.stdout.split()[0])
    assert wait_gone(worker), "the orphaned worker kept running"


def test_close_removes_the_private_socket_directory(fake_built_root):
    atoms = cu(2)
    calc = RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu")
    atoms.calc = calc
    atoms.get_potential_energy()
    session = calc._session
    run_dir = session._listener.run_dir if session._listener else None
    pid = calc.worker_pid
    calc.close()
    assert wait_gone(pid, 10)
    if run_dir is not None:
        assert not run_dir.exists()


def test_a_forked_child_gets_its_own_worker_and_leaves_the_parents_alone(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        atoms.calc = calc
        expected = atoms.get_potential_energy()
        parent_worker = calc.worker_pid
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            status = 1
            try:
                atoms.positions[0, 0] += 0.0  # same geometry, but a new process
                calc.results.clear()
                energy = atoms.get_potential_energy()
                os.write(write_end, json.dumps([energy, calc.worker_pid]).encode())
                calc.close()
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        _, child_status = os.waitpid(child, 0)
        energy, child_worker = json.loads(os.read(read_end, 4096))
        os.close(read_end)
        assert os.waitstatus_to_exitcode(child_status) == 0
        assert energy == pytest.approx(expected, abs=1e-10)
        assert child_worker != parent_worker
        assert is_running(parent_worker)
        atoms.positions[0, 0] += 0.01
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        assert calc.worker_pid == parent_worker


def test_a_stuck_calculation_times_out_and_the_next_call_recovers(fake_built_root):
    atoms = cu(2)
    with RootstockCalculator(
        root=fake_built_root, checkpoint="charge-emt", device="cpu", timeout=3
    ) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        stuck = calc.worker_pid
        atoms.info["sleep"] = 60
        started = time.monotonic()
        with pytest.raises(WorkerTimeout, match="did not answer within 3 s"):
            atoms.get_potential_energy()
        assert time.monotonic() - started < 20
        assert wait_gone(stuck, 10)
        del atoms.info["sleep"]
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)


def test_a_worker_that_dies_before_connecting_is_reported(tmp_path):
    root = build_fake_root(tmp_path / "root", {"emt": SAMPLE_EMT})
    python = root / "envs" / "emt" / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'the env interpreter is broken' >&2\nexit 7\n")
    with RootstockCalculator(root=root, checkpoint="emt", device="cpu", timeout=30) as calc:
        atoms = cu(2)
        atoms.calc = calc
        with pytest.raises(rootstock.WorkerDiedError) as caught:
            atoms.get_potential_energy()
    assert caught.value.worker_exit_code == 7
    assert "the env interpreter is broken" in caught.value.output_tail
