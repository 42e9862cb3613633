"""In-flight batching: a pooled worker merges concurrent clients' single calls.

The worker is the ``batch-emt`` test env (EMT with an ``evaluate_batch`` hook that
records each call it gets), slowed by ``delay`` per model call so that clients
queue behind it. Every client compares every result with EMT in its own process;
the hook's record and the daemon's counters show that calls were merged.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.socketio import SocketIOCalculator
from ase.io import read, write

from rootstock import RootstockCalculator
from rootstock.errors import WorkerError
from rootstock.ops.workers import list_workers
from rootstock.runtime.pool.merging import MAX_WAIT_ENV, MERGE_ENV
from tests.integration.conftest import process_group
from tests.integration.pooling import wait_for
from tests.integration.test_ipi_interop import bfgs_energies

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(900)]

DELAY = 0.03
CALLS = 15
STEPS = 12
SYSTEMS = [("Cu", 1), ("Ag", 2), ("Au", 1), ("Ni", 2), ("Al", 1), ("Pd", 2), ("Pt", 1), ("Cu", 2)]

# One client process: CALLS rattled single points of its own system against the
# pooled batch-emt worker, each compared with EMT here. Prints one JSON line.
CLIENT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from rootstock import RootstockCalculator

    root, record, delay, symbol, repeat, seed, calls = sys.argv[1:8]
    base = bulk(symbol, "fcc", cubic=True).repeat((int(repeat), 1, 1))
    calc = RootstockCalculator(
        "batch-emt", root=root, device="cpu", pool=True,
        setup_kwargs={"record": record, "delay": float(delay)},
    )
    worst, wrong = 0.0, None
    for i in range(int(calls)):
        atoms = base.copy()
        atoms.rattle(0.05, seed=int(seed) * 1000 + i)
        atoms.calc = calc
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        stress = atoms.get_stress()
        ref = atoms.copy()
        ref.calc = EMT()
        de = abs(energy - ref.get_potential_energy())
        df = float(np.max(np.abs(forces - ref.get_forces())))
        ds = float(np.max(np.abs(stress - ref.get_stress())))
        worst = max(worst, de, df, ds)
        if max(de, df, ds) > 1e-10 and wrong is None:
            wrong = {"call": i, "energy": energy, "expected": ref.get_potential_energy()}
    calc.close()
    print(json.dumps({"worst": worst, "wrong": wrong}), flush=True)
    """
)


def setup_kwargs(record: Path) -> dict:
    return {"record": str(record), "delay": DELAY}


def pooled_clients(root: Path, record: Path, count: int) -> list[RootstockCalculator]:
    """``count`` calculators in this process, each its own connection to one pooled
    batch-emt worker (shared=False), as separate processes would be."""
    return [
        RootstockCalculator(
            "batch-emt", root=root, device="cpu", pool=True, shared=False,
            setup_kwargs=setup_kwargs(record),
        )
        for _ in range(count)
    ]  # fmt: skip


def hook_calls(record: Path) -> list[dict]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines()]


def the_worker():
    (worker,) = list_workers()
    return worker


def run_clients(root: Path, record: Path, env: dict[str, str] | None = None) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(root), str(record), str(DELAY),
             symbol, str(repeat), str(seed), str(CALLS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        for seed, (symbol, repeat) in enumerate(SYSTEMS)
    ]  # fmt: skip
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


def test_eight_clients_are_merged_and_each_gets_its_own_results(
    fake_built_root, pool_dir, tmp_path
):
    _, remember = pool_dir
    record = tmp_path / "hook.jsonl"
    reports = run_clients(fake_built_root, record)
    remember()
    for (symbol, repeat), report in zip(SYSTEMS, reports, strict=True):
        assert report["wrong"] is None, f"{symbol} x{repeat}: {report['wrong']}"
        assert report["worst"] <= 1e-10
    merged = [call for call in hook_calls(record) if call["size"] > 1]
    assert merged, "no call reached the hook merged with another"
    # A turn's calls go to the hook once per way of asking: with stress (most), or
    # without it (each client's first call, before get_stress asked for it).
    asked = {tuple(call["properties"]) for call in merged}
    assert asked <= {("energy", "forces", "stress"), ("energy", "forces")}
    assert max(call["size"] for call in merged) <= len(SYSTEMS)

    # Each client's first structure costs two calls (stress is asked for after forces).
    calls = len(SYSTEMS) * (CALLS + 1)
    wait_for(lambda: the_worker().stats.get("requests") == calls, 30, "the daemon's counters")
    worker = the_worker()
    stats = worker.stats
    assert worker.merging == {"enabled": True, "worker": True, "max_wait_ms": 0.0}
    # Every call of a merged turn reaches the hook (the worker's first sized calls may
    # split a turn in its memory probe, so hook calls are not turns).
    assert stats["merged_batches"] >= 1
    assert sum(call["size"] for call in hook_calls(record)) >= 2 * stats["merged_batches"]
    assert len(SYSTEMS) >= stats["batch_size_max"] >= max(call["size"] for call in merged)
    assert stats["batches"] < stats["requests"]
    assert stats["batch_size_mean"] == pytest.approx(stats["requests"] / stats["batches"])
    assert stats["queue_wait_ms"]["p50"] <= stats["queue_wait_ms"]["p99"]


def test_with_merging_off_every_call_goes_alone(fake_built_root, pool_dir, tmp_path):
    _, remember = pool_dir
    record = tmp_path / "hook.jsonl"
    reports = run_clients(fake_built_root, record, env={**os.environ, MERGE_ENV: "0"})
    remember()
    assert all(report["wrong"] is None for report in reports)
    assert hook_calls(record) == []  # no call went through the hook
    calls = len(SYSTEMS) * (CALLS + 1)  # as above: two calls for each first structure
    wait_for(lambda: the_worker().stats.get("requests") == calls, 30, "the daemon's counters")
    worker = the_worker()
    assert worker.merging["enabled"] is False
    assert worker.stats["merged_batches"] == 0 and worker.stats["batch_size_max"] == 1


def rattled(symbol: str, repeat: int, seed: int):
    atoms = bulk(symbol, "fcc", cubic=True).repeat((repeat, 1, 1))
    atoms.rattle(0.05, seed=seed)
    return atoms


def emt_energy(atoms) -> float:
    ref = atoms.copy()
    ref.calc = EMT()
    return ref.get_potential_energy()


def test_a_bad_structure_fails_only_its_own_client(fake_built_root, pool_dir, tmp_path):
    """Uranium (EMT has none) among good structures: the hook fails the merged batch
    as a whole, the worker re-runs it one at a time, and only that client errs."""
    _, remember = pool_dir
    record = tmp_path / "hook.jsonl"
    calcs = pooled_clients(fake_built_root, record, 4)
    errors: list[str] = []
    wrong: list[str] = []
    bad_errors: list[WorkerError] = []

    def good(index: int, calc: RootstockCalculator) -> None:
        for i in range(CALLS):
            atoms = rattled("Cu", 1, index * 1000 + i)
            atoms.calc = calc
            try:
                energy = atoms.get_potential_energy()
            except Exception as exc:
                errors.append(f"client {index} call {i}: {exc!r}")
                return
            if abs(energy - emt_energy(atoms)) > 1e-10:
                wrong.append(f"client {index} call {i}: {energy}")

    def bad(calc: RootstockCalculator) -> None:
        for i in range(CALLS):
            atoms = rattled("Cu", 1, 99_000 + i)
            atoms.numbers[0] = 92
            atoms.calc = calc
            try:
                atoms.get_potential_energy()
            except WorkerError as exc:
                bad_errors.append(exc)

    threads = [threading.Thread(target=good, args=(i, c)) for i, c in enumerate(calcs[:3])]
    threads.append(threading.Thread(target=bad, args=(calcs[3],)))
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        remember()
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [] and wrong == []
        assert len(bad_errors) == CALLS
        assert all("U" in str(exc) for exc in bad_errors), bad_errors[0]
        # The bad structure met the others in a merged batch, which the hook failed.
        assert any(call["failed"] and call["size"] > 1 for call in hook_calls(record))
        # The worker is still the same one, and still right.
        pids = {calc.worker_pid for calc in calcs}
        assert len(pids) == 1
        atoms = rattled("Ag", 1, 7)
        atoms.calc = calcs[3]
        assert abs(atoms.get_potential_energy() - emt_energy(atoms)) <= 1e-10
    finally:
        for calc in calcs:
            calc.close()


# A client that makes slow calls forever, until it is killed.
VICTIM = textwrap.dedent(
    """
    import sys
    from ase.build import bulk
    from rootstock import RootstockCalculator

    root, record, delay = sys.argv[1:4]
    calc = RootstockCalculator(
        "batch-emt", root=root, device="cpu", pool=True,
        setup_kwargs={"record": record, "delay": float(delay)},
    )
    atoms = bulk("Ni", "fcc", cubic=True).repeat((2, 2, 1))
    atoms.calc = calc
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        atoms.rattle(0.01, seed=i)
        atoms.get_potential_energy()
    """
)


def test_a_client_killed_while_queued_or_merged_leaves_the_others_served(
    fake_built_root, pool_dir, tmp_path
):
    _, remember = pool_dir
    record = tmp_path / "hook.jsonl"
    calcs = pooled_clients(fake_built_root, record, 3)
    victims = [
        subprocess.Popen(
            [sys.executable, "-c", VICTIM, str(fake_built_root), str(record), str(DELAY)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    failures: list[str] = []
    stop = threading.Event()

    def client(index: int, calc: RootstockCalculator) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            atoms = rattled(SYSTEMS[index][0], SYSTEMS[index][1], index * 10_000 + i)
            atoms.calc = calc
            try:
                energy = atoms.get_potential_energy()
            except Exception as exc:
                failures.append(f"client {index}: {exc!r}")
                return
            if abs(energy - emt_energy(atoms)) > 1e-10:
                failures.append(f"client {index} call {i}: wrong energy {energy}")

    threads = [threading.Thread(target=client, args=(i, c)) for i, c in enumerate(calcs)]
    try:
        for victim in victims:
            assert victim.stdout is not None
            assert victim.stdout.readline().strip() == "ready", victim.stderr.read()
        for thread in threads:
            thread.start()
        # Kill the victims while their calls queue and merge with the others'.
        wait_for(lambda: any(c["size"] > 2 for c in hook_calls(record)), 120, "merged batches")
        for victim in victims:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(30)
        before = len(hook_calls(record))
        wait_for(lambda: len(hook_calls(record)) >= before + 10, 120, "more merged batches")
        stop.set()
        for thread in threads:
            thread.join(120)
        remember()
        assert failures == []
        (worker,) = list_workers()
        assert worker.worker_pid == calcs[0].worker_pid  # the daemon and worker stayed up
    finally:
        stop.set()
        for victim in victims:
            if victim.poll() is None:
                os.killpg(victim.pid, signal.SIGKILL)
                victim.wait(30)
        for calc in calcs:
            calc.close()


def test_calls_of_a_client_asking_for_extras_are_not_merged(fake_built_root, pool_dir, tmp_path):
    """The hook returns no extras, so a system that asks for some goes alone."""
    _, remember = pool_dir
    record = tmp_path / "hook.jsonl"
    calcs = pooled_clients(fake_built_root, record, 3)
    try:

        def energies(calc: RootstockCalculator, out: list) -> None:
            for i in range(10):
                atoms = rattled("Cu", 2, i)
                atoms.calc = calc
                out.append(atoms.get_potential_energies())

        results: list[list] = [[] for _ in calcs]
        threads = [
            threading.Thread(target=energies, args=(c, r))
            for c, r in zip(calcs, results, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        remember()
        assert hook_calls(record) == []
        for out in results:
            assert len(out) == 10
            for i, values in enumerate(out):
                ref = rattled("Cu", 2, i)
                ref.calc = EMT()
                np.testing.assert_allclose(values, ref.get_potential_energies(), atol=1e-10)
    finally:
        for calc in calcs:
            calc.close()


def serve_pooled_argv(root: Path, socket_path: str, structure: Path, record: Path) -> list[str]:
    return [
        sys.executable, "-m", "rootstock.cli.main", "serve", "batch-emt",
        "--socket", socket_path, "--structure", str(structure), "--root", str(root),
        "--device", "cpu", "--connect-timeout", "120", "--pool",
        "--kwarg", f"record={record}", "--kwarg", f"delay={DELAY}",
    ]  # fmt: skip


def test_two_ipi_drivers_through_serve_pool_are_merged(
    fake_built_root, pool_dir, tmp_path, monkeypatch
):
    """Two ASE i-PI servers, each driven by ``rootstock serve --pool`` on one pooled
    worker. Two clients in lockstep would each find the other's call at the worker,
    so the daemon may hold a call up to 2 s for company (it stops waiting as soon as
    both are queued)."""
    _, remember = pool_dir
    monkeypatch.setenv(MAX_WAIT_ENV, "2000")
    record = tmp_path / "hook.jsonl"
    starts = []
    for symbol in ("Cu", "Ag"):
        atoms = rattled(symbol, 2, 5)
        path = tmp_path / f"{symbol}.xyz"
        write(path, atoms, format="extxyz")
        starts.append((read(path), path))
    expected = [bfgs_energies(atoms.copy(), EMT(), STEPS) for atoms, _ in starts]
    got: list[list[float]] = [[], []]
    names = [f"rs-merge-{uuid.uuid4().hex[:10]}" for _ in starts]
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(SocketIOCalculator(unixsocket=name, timeout=120)) for name in names
        ]
        logs = [stack.enter_context(open(tmp_path / f"serve-{i}.log", "wb")) for i in (0, 1)]
        serves = [
            stack.enter_context(
                process_group(
                    serve_pooled_argv(fake_built_root, f"/tmp/ipi_{name}", path, record),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            for name, (_, path), log in zip(names, starts, logs, strict=True)
        ]

        def drive(i: int) -> None:
            got[i] = bfgs_energies(starts[i][0], servers[i], STEPS)

        threads = [threading.Thread(target=drive, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        remember()
        workers = list_workers()
        # Both drivers were clients of one pooled worker, which merged their calls.
        assert [w.clients for w in workers] == [2], [(w.id, w.clients) for w in workers]
        assert workers[0].merging["worker"] is True, workers[0]
        for server in servers:
            server.close()  # the server hangs up; serve sees EOF and exits 0
        for i, serve in enumerate(serves):
            assert serve.wait(timeout=60) == 0, (tmp_path / f"serve-{i}.log").read_text()
    for mine, theirs in zip(got, expected, strict=True):
        assert len(mine) == len(theirs) == STEPS + 1
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-8)
    sizes = [call["size"] for call in hook_calls(record)]
    stats = workers[0].stats
    assert sizes.count(2) >= STEPS // 2, (sizes, stats)  # most steps went together
