"""Calculators of one process with the same worker key share one real worker.

Real workers in real uv-built envs (EMT): the key decides who shares, calls are
serialised, close() is counted, a death or a hotfix gives a fresh worker, and
copies (deepcopy, pickle) share in-process and spawn their own elsewhere.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.mep import NEB

from rootstock import RootstockCalculator
from rootstock.errors import WorkerDiedError, WorkerTimeout
from rootstock.runtime import shared
from tests.integration.killing import is_running, worker_children
from tests.integration.structures import cu, emt_energy

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(180)]


def energy(calc: RootstockCalculator, atoms) -> float:
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy()


def wait_gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(pid)


@pytest.fixture
def calcs():
    """Calculators made by a test; every one is closed at teardown."""
    import gc

    gc.collect()  # calculators other tests left unclosed let go of their workers
    before = set(shared.held_keys())
    made: list[RootstockCalculator] = []

    def make(**kwargs) -> RootstockCalculator:
        kwargs.setdefault("checkpoint", "emt")
        kwargs.setdefault("device", "cpu")
        calc = RootstockCalculator(**kwargs)
        made.append(calc)
        return calc

    yield make
    for calc in made:
        calc.close()
    # The last close of each key let go of its worker.
    assert set(shared.held_keys()) <= before


def test_same_key_shares_one_worker_and_computes_right(fake_built_root, calcs):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root)
    atoms, other = cu(2), cu(2, seed=1)
    assert energy(a, atoms) == pytest.approx(emt_energy(atoms), abs=1e-10)
    assert energy(b, other) == pytest.approx(emt_energy(other), abs=1e-10)
    assert a.worker_pid is not None and a.worker_pid == b.worker_pid
    assert worker_children(fake_built_root) == [a.worker_pid]
    # Alternating systems: each call re-sends its own system (INIT) to the one worker.
    assert energy(a, atoms) == pytest.approx(emt_energy(atoms), abs=1e-10)


@pytest.mark.parametrize(
    "other",
    [
        {"device": "cuda"},
        {"setup_kwargs": {"asap_cutoff": True}},
        {"checkpoint": "charge-emt"},
        {"shared": False},
    ],
    ids=["device", "setup_kwargs", "checkpoint", "unshared"],
)
def test_a_different_key_or_shared_false_gets_its_own_worker(fake_built_root, calcs, other):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root, **other)
    energy(a, cu(2))
    energy(b, cu(2))
    assert a.worker_pid is not None and b.worker_pid is not None
    assert a.worker_pid != b.worker_pid
    # The opt-out's close stops its own worker, never the shared one.
    b_pid = b.worker_pid
    b.close()
    assert wait_gone(b_pid)
    assert is_running(a.worker_pid)


def test_close_is_counted_and_a_closed_calculator_rejoins(fake_built_root, calcs):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root)
    energy(a, cu(2))
    energy(b, cu(2))
    pid = a.worker_pid
    a.close()
    assert a.worker_pid is None
    assert is_running(pid) and b.worker_pid == pid
    assert energy(b, cu(2, seed=3)) == pytest.approx(emt_energy(cu(2, seed=3)), abs=1e-10)
    # A closed calculator computes again, joining the worker still held by b.
    energy(a, cu(2, seed=4))
    assert a.worker_pid == pid
    a.close()
    b.close()
    assert wait_gone(pid)
    assert a._hold.lease is None and b._hold.lease is None


def test_garbage_collection_drops_a_hold(fake_built_root, calcs):
    import gc

    b = calcs(root=fake_built_root)
    energy(b, cu(2))
    pid = b.worker_pid
    a = RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu")
    energy(a, cu(2))
    assert a.worker_pid == pid
    del a
    gc.collect()
    assert is_running(pid)  # b still holds it
    b.close()
    assert wait_gone(pid)


def test_threads_interleave_through_one_worker(fake_built_root, calcs):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root)
    # Different sizes, so every switch between the threads re-sends INIT.
    work = {a: [cu(2, seed=s) for s in range(12)], b: [cu(1, seed=s) for s in range(12)]}
    expected = {calc: [emt_energy(x) for x in systems] for calc, systems in work.items()}
    got: dict[RootstockCalculator, list[float]] = {a: [], b: []}
    failures: list[BaseException] = []

    def run(calc: RootstockCalculator) -> None:
        try:
            for atoms in work[calc]:
                got[calc].append(energy(calc, atoms))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures
    for calc in (a, b):
        np.testing.assert_allclose(got[calc], expected[calc], rtol=0, atol=1e-10)
    assert a.worker_pid == b.worker_pid
    assert len(worker_children(fake_built_root)) == 1


def test_a_killed_shared_worker_is_replaced_for_every_sharer(fake_built_root, calcs):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root)
    energy(a, cu(2))
    energy(b, cu(1))
    old = a.worker_pid
    os.kill(old, signal.SIGKILL)
    assert wait_gone(old)
    with pytest.raises(WorkerDiedError):
        energy(a, cu(2, seed=5))
    # b's next call starts the new worker, and a's next call finds it.
    assert energy(b, cu(1, seed=6)) == pytest.approx(emt_energy(cu(1, seed=6)), abs=1e-10)
    assert energy(a, cu(2, seed=7)) == pytest.approx(emt_energy(cu(2, seed=7)), abs=1e-10)
    assert a.worker_pid == b.worker_pid
    assert a.worker_pid not in (None, old)
    assert worker_children(fake_built_root) == [a.worker_pid]


def test_a_hotfix_gives_new_calculators_a_new_worker(own_root, calcs):
    old = calcs(root=own_root)
    energy(old, cu(2))
    old_pid = old.worker_pid
    source = own_root / "envs" / "emt" / "env_source.py"
    text = source.read_text()
    source.unlink()  # never write through a link the build may share
    source.write_text(text + "\n# hotfix: a harmless comment\n")
    new = calcs(root=own_root)
    energy(new, cu(2))
    assert new.worker_pid not in (None, old_pid)
    assert old.worker_pid == old_pid and is_running(old_pid)  # the old one keeps its own
    assert energy(old, cu(2, seed=2)) == pytest.approx(emt_energy(cu(2, seed=2)), abs=1e-10)
    held = [key for key in shared.held_keys() if key and key[0].root == str(own_root)]
    assert len(held) == 2 and held[0][0].source_sha256 != held[1][0].source_sha256


def test_copies_share_in_process(fake_built_root, calcs):
    a = calcs(root=fake_built_root, timeout=77.0, setup_kwargs={"asap_cutoff": False})
    atoms = cu(2)
    atoms.calc = a
    e = atoms.get_potential_energy()
    deep = copy.deepcopy(a)
    pickled = pickle.loads(pickle.dumps(a))
    for twin in (deep, pickled):
        assert (twin.spec, twin.timeout, twin.shared, twin.pool) == (a.spec, 77.0, True, False)
        assert twin.results["energy"] == e  # ASE copies results along with the atoms
        assert twin.worker_pid is None  # no session is copied; it joins at its first call
        assert energy(twin, cu(2, seed=8)) == pytest.approx(emt_energy(cu(2, seed=8)), abs=1e-10)
        assert twin.worker_pid == a.worker_pid
        twin.close()
    assert a.worker_pid is not None and is_running(a.worker_pid)


UNPICKLE = """
import pickle, sys
from ase.build import bulk
calc = pickle.loads(open(sys.argv[1], "rb").read())
atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 2, 2)
atoms.rattle(0.05, seed=9)  # not the pickled results' structure: this one computes
atoms.calc = calc
print(repr(atoms.get_potential_energy()), calc.worker_pid)
calc.close()
"""


def test_unpickled_in_another_process_it_spawns_there(fake_built_root, calcs, tmp_path):
    a = calcs(root=fake_built_root)
    e = energy(a, cu(2))
    blob = tmp_path / "calc.pickle"
    blob.write_bytes(pickle.dumps(a))
    out = subprocess.run(
        [sys.executable, "-c", UNPICKLE, str(blob)],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr
    child_energy, child_pid = out.stdout.split()
    assert float(child_energy) == pytest.approx(emt_energy(cu(2, seed=9)), abs=1e-10)
    assert float(child_energy) != pytest.approx(e, abs=1e-6)
    assert int(child_pid) != a.worker_pid
    assert is_running(a.worker_pid)


def test_second_sharer_learns_the_model_report(fake_built_root, calcs):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root)
    atoms = cu(2)
    energy(a, atoms)
    assert "energies" in a.implemented_properties  # EMT fills per-atom energies
    # Same system as a's last call: no INIT, so the worker sends b no report.
    moved = atoms.copy()
    moved.positions[0] += 0.01
    energy(b, moved)
    assert b.worker_pid == a.worker_pid
    assert b.implemented_properties == a.implemented_properties
    assert b.model_dtype == a.model_dtype == "float64"


def test_neb_images_made_by_deepcopy_use_one_worker(fake_built_root, calcs):
    template = calcs(root=fake_built_root)
    initial = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 2, 2)
    del initial[0]
    final = initial.copy()
    # The neighbour at (0, a/2, a/2) hops into the vacancy at the origin.
    hop = int(np.argmin(np.linalg.norm(initial.positions - [0, 1.81, 1.81], axis=1)))
    final.positions[hop] = [0.0, 0.0, 0.0]
    images = [initial] + [initial.copy() for _ in range(3)] + [final]
    for image in images:
        image.calc = copy.deepcopy(template)
    neb = NEB(images, method="improvedtangent")
    neb.interpolate()
    forces = neb.get_forces()
    assert forces.shape == (3 * len(initial), 3) and np.isfinite(forces).all()
    pids = {image.calc.worker_pid for image in images[1:-1]}
    assert len(pids) == 1 and None not in pids
    assert worker_children(fake_built_root) == list(pids)
    reference = images[2].copy()
    assert images[2].get_potential_energy() == pytest.approx(emt_energy(reference), abs=1e-10)
    for image in images:
        image.calc.close()


def test_a_forked_child_shares_a_worker_of_its_own(fake_built_root, calcs):
    a = calcs(root=fake_built_root)
    b = calcs(root=fake_built_root)
    energy(a, cu(2))
    parent_worker = a.worker_pid
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        status = 1
        try:
            energies = [energy(a, cu(2, seed=10)), energy(b, cu(1, seed=11))]
            os.write(write_end, json.dumps([energies, a.worker_pid, b.worker_pid]).encode())
            a.close()
            b.close()
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    _, child_status = os.waitpid(child, 0)
    energies, child_a, child_b = json.loads(os.read(read_end, 4096))
    os.close(read_end)
    assert os.waitstatus_to_exitcode(child_status) == 0
    assert energies == pytest.approx([emt_energy(cu(2, seed=10)), emt_energy(cu(1, seed=11))])
    assert child_a == child_b and child_a != parent_worker
    assert is_running(parent_worker)
    assert energy(b, cu(2, seed=12)) == pytest.approx(emt_energy(cu(2, seed=12)), abs=1e-10)
    assert a.worker_pid == b.worker_pid == parent_worker


def test_timeout_is_per_call_and_a_timeout_replaces_the_shared_worker(fake_built_root, calcs):
    patient = calcs(root=fake_built_root, checkpoint="charge-emt", timeout=60)
    hasty = calcs(root=fake_built_root, checkpoint="charge-emt", timeout=2)
    slow = cu(1)
    slow.info["sleep"] = 3
    assert energy(patient, slow) == pytest.approx(emt_energy(slow), abs=1e-10)
    first = patient.worker_pid
    with pytest.raises(WorkerTimeout):
        energy(hasty, slow)  # the same worker, under its own timeout
    assert wait_gone(first)
    assert energy(patient, cu(1, seed=13)) == pytest.approx(emt_energy(cu(1, seed=13)))
    assert hasty.worker_pid == patient.worker_pid not in (None, first)


@pytest.fixture
def private_pool(monkeypatch):
    """A private 0700 runtime dir for pool daemons; every daemon in it is stopped."""
    import shutil
    import tempfile

    from rootstock.ops.workers import list_workers, stop_workers

    runtime = Path(tempfile.mkdtemp(prefix="rs-share-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("ROOTSTOCK_POOL", raising=False)
    yield
    pids = [p for w in list_workers() for p in (w.daemon_pid, w.worker_pid) if p]
    stop_workers([], all_workers=True)
    for pid in pids:
        if is_running(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(runtime, ignore_errors=True)


def test_pooled_calculators_share_one_attachment(fake_built_root, calcs, private_pool):
    a = calcs(root=fake_built_root, pool=True)
    b = calcs(root=fake_built_root, pool=True)
    assert energy(a, cu(2)) == pytest.approx(emt_energy(cu(2)), abs=1e-10)
    assert energy(b, cu(1)) == pytest.approx(emt_energy(cu(1)), abs=1e-10)
    assert a._session is b._session  # one connection to the daemon, not two
    assert a.worker_pid == b.worker_pid is not None
    # An unpooled calculator with the same worker key spawns a worker of its own.
    c = calcs(root=fake_built_root)
    energy(c, cu(2))
    assert c.worker_pid != a.worker_pid
    a.close()
    assert b._session is not None and b._session.alive
