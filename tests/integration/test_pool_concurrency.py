"""Many clients of one pooled worker at once, each with its own system: every result right.

The review's reproduction: clients of different species and sizes making rattled
single points against one pool daemon got each other's systems (the daemon chose
whether to re-send a client's INIT before it took the worker lock). Here 8
processes, 8 threads with a connection each, 8 threads sharing one calculator, and
processes that interleave ``calculate_batch`` with single calls all compare every
energy and force with EMT run in their own process, to 1e-10.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock.ops.workers import list_workers
from tests.integration.pooling import pooled

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(900)]

CALLS = 200
# (species, repeat): four 4-atom and four 8-atom cells, so a mixed-up system shows
# as a wrong energy or a wrong atom count.
SYSTEMS = [
    ("Cu", 1),
    ("Ag", 2),
    ("Au", 1),
    ("Ni", 2),
    ("Al", 1),
    ("Pd", 2),
    ("Pt", 1),
    ("Cu", 2),
]

# One client process: its own species and size, CALLS rattled single points (and,
# in "mixed" mode, a calculate_batch of three structures every fifth call), each
# compared with in-process EMT. Prints one JSON line: calls made, the largest
# deviation, and the first wrong result (or null).
CLIENT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from rootstock import RootstockCalculator

    root, symbol, repeat, seed, calls, mode = sys.argv[1:7]
    repeat, seed, calls = int(repeat), int(seed), int(calls)
    base = bulk(symbol, "fcc", cubic=True).repeat((repeat, 1, 1))
    calc = RootstockCalculator("emt", root=root, device="cpu", pool=True)
    worst, wrong, made = 0.0, None, 0

    def check(atoms, energy, forces):
        global worst, wrong
        ref = atoms.copy()
        ref.calc = EMT()
        de = abs(energy - ref.get_potential_energy())
        df = float(np.max(np.abs(forces - ref.get_forces())))
        worst = max(worst, de, df)
        if (de > 1e-10 or df > 1e-10) and wrong is None:
            wrong = {"call": made, "energy": energy, "expected": ref.get_potential_energy()}

    for i in range(calls):
        atoms = base.copy()
        atoms.rattle(0.05, seed=seed * 1000 + i)
        if mode == "mixed" and i % 5 == 4:
            images = []
            for k in range(3):
                image = base.copy()
                image.rattle(0.05, seed=seed * 1000 + i + 100000 * (k + 1))
                images.append(image)
            for image, result in zip(images, calc.calculate_batch(images, ["energy", "forces"])):
                check(image, result["energy"], result["forces"])
        atoms.calc = calc
        check(atoms, atoms.get_potential_energy(), atoms.get_forces())
        made += 1
    calc.close()
    print(json.dumps({"calls": made, "worst": worst, "wrong": wrong}), flush=True)
    """
)


def structure(symbol: str, repeat: int):
    return bulk(symbol, "fcc", cubic=True).repeat((repeat, 1, 1))


def run_clients(root: Path, mode: str) -> list[dict]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CLIENT,
                str(root),
                symbol,
                str(repeat),
                str(seed),
                str(CALLS),
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for seed, (symbol, repeat) in enumerate(SYSTEMS)
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads(out.splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return reports


def assert_all_right(reports: list[dict]) -> None:
    for (symbol, repeat), report in zip(SYSTEMS, reports, strict=True):
        assert report["wrong"] is None, f"{symbol} x{repeat}: {report['wrong']}"
        assert report["calls"] == CALLS and report["worst"] <= 1e-10


def test_eight_processes_of_different_systems_each_get_their_own_results(fake_built_root, pool_dir):
    _, remember = pool_dir
    reports = run_clients(fake_built_root, "single")
    remember()
    assert_all_right(reports)
    (worker,) = list_workers()  # they all shared one pooled worker
    assert worker.clients == 0


def test_processes_interleaving_batches_and_single_calls_get_their_own_results(
    fake_built_root, pool_dir
):
    _, remember = pool_dir
    reports = run_clients(fake_built_root, "mixed")
    remember()
    assert_all_right(reports)


def _thread_client(calc, symbol: str, repeat: int, seed: int, failures: list[str]) -> None:
    base = structure(symbol, repeat)
    for i in range(CALLS):
        atoms = base.copy()
        atoms.rattle(0.05, seed=seed * 1000 + i)
        atoms.calc = calc
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        ref = atoms.copy()
        ref.calc = EMT()
        de = abs(energy - ref.get_potential_energy())
        df = float(np.max(np.abs(forces - ref.get_forces())))
        if de > 1e-10 or df > 1e-10:
            failures.append(
                f"{symbol} x{repeat} call {i}: energy {energy}, dE {de:.3g}, dF {df:.3g}"
            )
            return


def run_threads(calcs) -> list[str]:
    failures: list[str] = []
    threads = [
        threading.Thread(target=_thread_client, args=(calc, symbol, repeat, seed, failures))
        for seed, ((symbol, repeat), calc) in enumerate(zip(SYSTEMS, calcs, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not any(thread.is_alive() for thread in threads), "a client thread hung"
    return failures


def test_threads_with_a_connection_each_get_their_own_results(fake_built_root, pool_dir):
    _, remember = pool_dir
    # shared=False: each thread's calculator is its own connection to the daemon.
    calcs = [pooled(fake_built_root, shared=False) for _ in SYSTEMS]
    try:
        failures = run_threads(calcs)
        remember()
        assert len({calc.worker_pid for calc in calcs}) == 1
    finally:
        for calc in calcs:
            calc.close()
    assert failures == []


def test_threads_sharing_one_calculator_get_their_own_results(fake_built_root, pool_dir):
    _, remember = pool_dir
    with pooled(fake_built_root) as calc:
        failures = run_threads([calc] * len(SYSTEMS))
        remember()
    assert failures == []
