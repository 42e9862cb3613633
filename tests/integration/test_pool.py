"""The user's worker pool: daemons shared across processes, their CLI, and their faults.

Real envs (fake_built_root's emt and charge-emt, a private root for the hotfix and
for the usage spool),
real daemons and workers, and client processes run by the dev Python. Each test
gets a private 0700 XDG_RUNTIME_DIR, and its teardown stops every daemon it
started (``workers stop --all``, then SIGKILL by pid for anything left).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from ase.calculators.emt import EMT

from rootstock.errors import RootstockError, WorkerDiedError, WorkerError
from rootstock.install.machine import resolve_layout
from rootstock.ops.workers import list_workers
from tests.conftest import run_rootstock
from tests.integration.killing import is_running
from tests.integration.pooling import pooled, wait_for
from tests.integration.structures import al, cu, emt_energy

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(180)]

# What every entry of `rootstock workers list --json` carries (docs/cli.md).
WORKER_FIELDS = {
    "merging",
    "stats",
    "id",
    "checkpoint",
    "env",
    "device",
    "root",
    "daemon_pid",
    "worker_pid",
    "clients",
    "started",
    "idle_timeout",
    "stale",
    "socket",
    "log",
}


CLIENT = textwrap.dedent(
    """
    import json, sys, time
    from ase.build import bulk
    from rootstock import RootstockCalculator
    root, checkpoint, sleep = sys.argv[1], sys.argv[2], float(sys.argv[3])
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=0)
    if sleep:
        atoms.info["sleep"] = sleep
    calc = RootstockCalculator(checkpoint, root=root, device="cpu", pool=True)
    atoms.calc = calc
    print("calling", flush=True)
    energy = atoms.get_potential_energy()
    print(json.dumps({"energy": energy, "pid": calc.worker_pid}), flush=True)
    """
)


def client_process(root: Path, checkpoint: str = "emt", sleep: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(root), checkpoint, str(sleep)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_pooled_worker_outlives_its_calculator_and_serves_another_process(own_root, pool_dir):
    directory, remember = pool_dir
    atoms = cu(1, a=3.6)
    with pooled(own_root) as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        worker_pid = calc.worker_pid
    remember()
    (worker,) = list_workers()
    assert worker.worker_pid == worker_pid and is_running(worker.daemon_pid)
    assert is_running(worker_pid)  # closing the calculator only disconnected it
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    assert oct(os.stat(worker.socket).st_mode & 0o777) == "0o600"

    # A usage spool in a private root: in the run's shared root, every other pytest
    # process's sessions would drop their records in it too.
    spool = resolve_layout(own_root).usage_dir
    spool.mkdir()
    try:
        proc = client_process(own_root)
        out, err = proc.communicate(timeout=30)
        records = [json.loads(path.read_text()) for path in spool.glob("*.json")]
    finally:
        shutil.rmtree(spool)
    assert proc.returncode == 0, err
    reply = json.loads(out.splitlines()[-1])
    assert reply["pid"] == worker_pid
    assert reply["energy"] == pytest.approx(emt_energy(atoms), abs=1e-10)
    # The client never closed its calculator: its session's record was written at exit.
    assert [(r["checkpoint"], r["force_calls"]) for r in records] == [("emt", 1)]

    listed = json.loads(run_rootstock("workers", "list", "--json").stdout)
    assert listed["schema"] == 1
    (entry,) = listed["workers"]
    assert set(entry) == WORKER_FIELDS
    assert entry["id"] == worker.id and entry["worker_pid"] == worker_pid
    assert (entry["checkpoint"], entry["env"], entry["device"]) == ("emt", "emt", "cpu")
    assert entry["clients"] == 0 and entry["stale"] is False and entry["idle_timeout"] == 600

    stopped = run_rootstock("workers", "stop", worker.id[:6], "--json")
    assert [w["id"] for w in json.loads(stopped.stdout)["stopped"]] == [worker.id]
    wait_for(lambda: not is_running(worker_pid), 10, "the stopped daemon's worker to exit")
    assert not is_running(worker.daemon_pid)
    assert list_workers() == [] and not Path(worker.socket).exists()


def test_two_clients_interleave_each_with_its_own_system(fake_built_root, pool_dir):
    _, remember = pool_dir
    first, second = cu(1, a=3.6), al()
    # shared=False: two connections to the daemon from one process, as two processes have.
    with pooled(fake_built_root, shared=False) as a, pooled(fake_built_root, shared=False) as b:
        first.calc, second.calc = a, b
        for step in range(4):
            first.rattle(0.01, seed=10 + step)
            second.rattle(0.01, seed=20 + step)
            assert first.get_potential_energy() == pytest.approx(emt_energy(first), abs=1e-10)
            assert second.get_potential_energy() == pytest.approx(emt_energy(second), abs=1e-10)
            assert second.get_forces() == pytest.approx(EMT().get_forces(second.copy()), abs=1e-10)
        assert a.worker_pid == b.worker_pid
        remember()
        (worker,) = list_workers()
        assert worker.clients == 2


def test_cli_start_idle_timeout_and_unknown_ids(fake_built_root, pool_dir):
    _, remember = pool_dir
    started = run_rootstock(
        "workers", "start", "emt", "--root", fake_built_root, "--device", "cpu",
        "--idle-timeout", "10",
    )  # fmt: skip
    worker_id = started.stdout.strip()
    remember()
    (worker,) = list_workers()
    # 10 s, not less: the refused stop below must find it still running on a loaded CI
    # machine, where one CLI start-up can take seconds.
    assert worker.id == worker_id and worker.idle_timeout == 10
    refused = run_rootstock("workers", "stop", "ffffffff", check=False)
    assert refused.returncode == 2
    assert "known ids" in refused.stderr and worker_id in refused.stderr
    # No client ever attached: it goes on its own.
    wait_for(lambda: not is_running(worker.daemon_pid), 40, "the idle daemon to exit")
    assert not is_running(worker.worker_pid)
    assert list_workers() == []
    # --all with nothing running is fine.
    assert run_rootstock("workers", "stop", "--all").returncode == 0


def test_stop_all_stops_every_daemon(fake_built_root, pool_dir):
    _, remember = pool_dir
    for checkpoint in ("emt", "charge-emt"):
        run_rootstock("workers", "start", checkpoint, "--root", fake_built_root, "--device", "cpu")
    remember()
    workers = list_workers()
    assert len(workers) == 2
    stopped = json.loads(run_rootstock("workers", "stop", "--all", "--json").stdout)
    assert {w["id"] for w in stopped["stopped"]} == {w.id for w in workers}
    for worker in workers:
        assert not is_running(worker.daemon_pid)
        wait_for(lambda w=worker: not is_running(w.worker_pid), 10, "the worker to exit")


@pytest.mark.timeout(300)  # builds a root of its own
def test_hotfix_gets_a_new_daemon_and_the_old_one_leaves_after_its_clients(own_root, pool_dir):
    _, remember = pool_dir
    atoms = cu(1, a=3.6)
    plain = emt_energy(atoms)
    old = pooled(own_root)
    atoms.calc = old
    assert atoms.get_potential_energy() == pytest.approx(plain, abs=1e-10)
    remember()
    (old_worker,) = list_workers()

    source = own_root / "envs" / "emt" / "env_source.py"
    hotfixed = source.read_text().replace(
        "    return EMT(**kw)",
        "    calc = EMT(**kw)\n"
        "    inner = calc.calculate\n"
        "    def calculate(*args, **kwargs):\n"
        "        inner(*args, **kwargs)\n"
        "        calc.results['energy'] += 1.25\n"
        "    calc.calculate = calculate\n"
        "    return calc",
    )
    staged = source.with_suffix(".new")
    staged.write_text(hotfixed)
    os.replace(staged, source)

    fresh_atoms = cu(1, a=3.6)
    with pooled(own_root) as fresh:
        fresh_atoms.calc = fresh
        assert fresh_atoms.get_potential_energy() == pytest.approx(plain + 1.25, abs=1e-10)
        assert fresh.worker_pid != old_worker.worker_pid
    remember()
    # The old daemon still serves its client, and now knows it is stale.
    atoms.rattle(0.01, seed=3)
    assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
    wait_for(
        lambda: any(w.id == old_worker.id and w.stale for w in list_workers()), 10, "stale mark"
    )
    old.close()
    wait_for(lambda: not is_running(old_worker.daemon_pid), 10, "the stale daemon to exit")
    assert [w.id for w in list_workers()] != [old_worker.id]


def test_worker_killed_mid_call_gives_worker_died_then_attaches_afresh(fake_built_root, pool_dir):
    _, remember = pool_dir
    atoms = cu(1, a=3.6)
    with pooled(fake_built_root, "charge-emt") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        first_pid = calc.worker_pid
        remember()
        atoms.info["sleep"] = 5
        killer = threading.Timer(1.0, os.kill, (first_pid, signal.SIGKILL))
        killer.start()
        try:
            with pytest.raises(WorkerDiedError, match="pooled worker"):
                atoms.get_potential_energy()
        finally:
            killer.cancel()
        del atoms.info["sleep"]
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        assert calc.worker_pid not in (None, first_pid)
        remember()


def test_client_killed_mid_call_does_not_wedge_the_others(fake_built_root, pool_dir):
    _, remember = pool_dir
    atoms = al()
    with pooled(fake_built_root, "charge-emt") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        pid = calc.worker_pid
        remember()
        proc = client_process(fake_built_root, "charge-emt", sleep=2.0)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "calling"
            time.sleep(0.7)  # in the worker's sleep by now
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.wait(10)
        atoms.rattle(0.02, seed=5)
        assert atoms.get_potential_energy() == pytest.approx(emt_energy(atoms), abs=1e-10)
        assert calc.worker_pid == pid


def test_setup_failure_reaches_the_client_and_leaves_no_daemon(fake_built_root, pool_dir):
    directory, _ = pool_dir
    atoms = cu(1, a=3.6)
    with pooled(fake_built_root, "broken-setup") as calc:
        atoms.calc = calc
        with pytest.raises(WorkerError, match=r"setup\(\): RuntimeError: broken on") as info:
            atoms.get_potential_energy()
    assert "Traceback" in info.value.remote_traceback
    assert list_workers() == []
    assert not list(directory.glob("*.sock"))


def test_pool_dir_with_the_wrong_mode_is_refused(fake_built_root, pool_dir):
    directory, _ = pool_dir
    directory.mkdir(mode=0o700)
    directory.chmod(0o755)
    atoms = cu(1, a=3.6)
    with pooled(fake_built_root) as calc:
        atoms.calc = calc
        with pytest.raises(RootstockError, match="mode 0755, not 0700"):
            atoms.get_potential_energy()
    refused = run_rootstock("workers", "list", check=False)
    assert refused.returncode == 1 and "chmod 700" in refused.stderr
