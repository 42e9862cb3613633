"""CommitteeCalculator: spreads in closed form, ASE runs, batches, faults, lifecycle.

The committee is ``emt`` (the sample env) and ``shifted-emt`` (tests/envs/shifted_emt.py:
EMT + 3 eV, forces and stress x 1.01), so every spread is known exactly: forces F
and 1.01 F have the mean 1.005 F and the population spread 0.005 |F| per component.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ase.calculators.calculator import Calculator, all_changes
from ase.calculators.emt import EMT
from ase.io import read
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS

import rootstock
from rootstock import CommitteeCalculator, RootstockCalculator, WorkerDiedError
from rootstock.committee import UncertaintyExceeded, watch
from rootstock.errors import UsageError
from tests.integration.killing import is_running
from tests.integration.pooling import wait_for
from tests.integration.structures import al, cu

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(180)]

SHIFT = 3.0  # tests/envs/shifted_emt.py: ENERGY_SHIFT
SCALE = 1.01  # FORCE_SCALE
PAIR = ["emt", "shifted-emt"]
TIGHT = {"rtol": 0, "atol": 1e-10}
GONE_WITHIN_S = 30.0


def committee(root: Path, checkpoints=PAIR, **kwargs) -> CommitteeCalculator:
    return CommitteeCalculator(checkpoints, root=root, device="cpu", **kwargs)


def emt_results(atoms) -> tuple[float, np.ndarray, np.ndarray]:
    own = atoms.copy()
    own.calc = EMT()
    return own.get_potential_energy(), own.get_forces(), own.get_stress()


def wait_gone(pids, timeout: float = GONE_WITHIN_S) -> None:
    wait_for(lambda: not any(is_running(p) for p in pids), timeout, f"workers {pids} to exit")


class SeparateMean(Calculator):
    """The mean of members run one after another, each its own RootstockCalculator."""

    implemented_properties = ("energy", "free_energy", "forces", "stress")  # type: ignore[assignment]

    def __init__(self, members: list[RootstockCalculator]) -> None:
        super().__init__()
        self.members = members

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        got = []
        for member in self.members:
            copy = self.atoms.copy()
            copy.calc = member
            got.append((copy.get_potential_energy(), copy.get_forces(), copy.get_stress()))
        energy = float(np.mean([g[0] for g in got]))
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": np.mean([g[1] for g in got], axis=0),
            "stress": np.mean([g[2] for g in got], axis=0),
        }


@pytest.fixture
def separate(fake_built_root):
    calcs = [RootstockCalculator(m, root=fake_built_root, device="cpu", shared=False) for m in PAIR]
    yield calcs
    for calc in calcs:
        calc.close()


# --- the numbers -----------------------------------------------------------------------


def test_spreads_of_emt_and_shifted_emt_are_the_closed_form_values(fake_built_root):
    atoms = cu(seed=0)
    energy, forces, stress = emt_results(atoms)
    with committee(fake_built_root) as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(energy + SHIFT / 2, abs=1e-10)
        np.testing.assert_allclose(atoms.get_forces(), forces * (1 + SCALE) / 2, **TIGHT)
        np.testing.assert_allclose(atoms.get_stress(), stress * (1 + SCALE) / 2, **TIGHT)
        r = calc.results
        assert r["energy_std"] == pytest.approx(SHIFT / 2, abs=1e-10)
        assert r["energy_std_relative"] == pytest.approx(0.0, abs=1e-10)
        half = (SCALE - 1) / 2
        np.testing.assert_allclose(r["forces_std"], half * np.abs(forces), rtol=1e-9, atol=1e-13)
        expected_dev = half * np.linalg.norm(forces, axis=1).max()
        assert r["max_force_dev"] == pytest.approx(expected_dev, rel=1e-9)
        assert expected_dev > 1e-4  # the rattle gives forces: a spread to measure
        np.testing.assert_allclose(r["stress_std"], half * np.abs(stress), rtol=1e-9, atol=1e-13)
        assert r["members"]["emt"]["energy"] == pytest.approx(energy, abs=1e-10)
        np.testing.assert_allclose(r["members"]["shifted-emt"]["forces"], forces * SCALE, **TIGHT)
        assert r["forces"].dtype == np.float64 and r["dropped"] == []
        # Another structure: the energies differ by the same offset, so the relative
        # spread (from this committee's first structure) stays 0 while energy_std does not.
        atoms.positions[0] += 0.05
        atoms.get_potential_energy()
        assert calc.results["energy_std_relative"] == pytest.approx(0.0, abs=1e-10)
        assert calc.results["energy_std"] == pytest.approx(SHIFT / 2, abs=1e-10)
        assert set(calc.energy_baseline) == set(PAIR)


def test_reference_member_gives_its_own_values_with_the_same_spreads(fake_built_root):
    atoms = cu(seed=1)
    energy, forces, stress = emt_results(atoms)
    with committee(fake_built_root, reference="emt") as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(energy, abs=1e-10)
        np.testing.assert_allclose(atoms.get_forces(), forces, **TIGHT)
        np.testing.assert_allclose(atoms.get_stress(), stress, **TIGHT)
        assert calc.results["energy_std"] == pytest.approx(SHIFT / 2, abs=1e-10)
        expected_dev = (SCALE - 1) / 2 * np.linalg.norm(forces, axis=1).max()
        assert calc.results["max_force_dev"] == pytest.approx(expected_dev, rel=1e-9)


# --- in ASE runs and batches ---------------------------------------------------------------


def test_bfgs_and_verlet_match_the_members_run_separately(fake_built_root, separate):
    mean = SeparateMean(separate)
    with committee(fake_built_root) as calc:
        paths = []
        for calculator in (calc, mean):
            atoms = cu(seed=2)
            atoms.calc = calculator
            steps: list[np.ndarray] = []
            opt = BFGS(atoms, logfile=None)
            opt.attach(lambda a=atoms, s=steps: s.append(a.positions.copy()))
            opt.run(fmax=1e-3, steps=3)
            atoms.set_momenta(np.zeros((len(atoms), 3)))
            md = VelocityVerlet(atoms, timestep=1.0, logfile=None)
            md.attach(lambda a=atoms, s=steps: s.append(a.positions.copy()))
            md.run(3)
            steps.append(np.array([atoms.get_potential_energy()]))
            paths.append(steps)
        assert len(paths[0]) == len(paths[1]) > 6
        for ours, theirs in zip(*paths, strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-9)


def test_calculate_batch_and_evaluate_match_the_members_run_separately(fake_built_root, separate):
    images = [cu(seed=s) for s in range(4)] + [al()]
    images[2].pbc = False  # no stress for this one, in any member
    alone = {m: c.calculate_batch(images) for m, c in zip(PAIR, separate, strict=True)}
    with committee(fake_built_root) as calc:
        results = calc.calculate_batch(images, batch_size=2)
        assert calc.results == {}  # left alone
        # Its own committee, on the same (shared) member workers.
        via_evaluate = rootstock.evaluate(
            images, checkpoints=PAIR, root=fake_built_root, batch_size=2
        )
    first = {m: alone[m][0]["energy"] for m in PAIR}
    for i, (got, again) in enumerate(zip(results, via_evaluate, strict=True)):
        a, b = (alone[m][i] for m in PAIR)
        assert got["energy"] == pytest.approx((a["energy"] + b["energy"]) / 2, abs=1e-10)
        np.testing.assert_allclose(got["forces"], (a["forces"] + b["forces"]) / 2, **TIGHT)
        np.testing.assert_allclose(
            got["forces_std"], np.abs(a["forces"] - b["forces"]) / 2, **TIGHT
        )
        rel = np.std([a["energy"] - first["emt"], b["energy"] - first["shifted-emt"]])
        assert got["energy_std_relative"] == pytest.approx(rel, abs=1e-10)
        assert ("stress" in got) == (i != 2) and ("stress_std" in got) == (i != 2)
        for m, own in zip(PAIR, (a, b), strict=True):
            assert got["members"][m]["energy"] == pytest.approx(own["energy"], abs=1e-10)
        assert set(again) == set(got)
        assert again["energy"] == pytest.approx(got["energy"], abs=1e-10)
        np.testing.assert_allclose(again["forces_std"], got["forces_std"], **TIGHT)


@pytest.mark.timeout(600)
def test_evaluate_on_dask_keeps_one_warm_worker_per_member_and_matches_local(fake_built_root):
    from rootstock.parallel import dask_local_client

    images = [cu(seed=s) for s in range(5)]
    here = rootstock.evaluate(images, checkpoints=PAIR, root=fake_built_root, batch_size=2)
    client = dask_local_client(workers=1)
    try:
        client.wait_for_workers(1, timeout=300)
        there = rootstock.evaluate(
            images, checkpoints=PAIR, root=fake_built_root, batch_size=2, executor=client
        )
        again = rootstock.evaluate(
            images[:2], checkpoints=PAIR, root=fake_built_root, batch_size=2, executor=client
        )

        def member_workers() -> list[str]:
            found = []
            for entry in os.listdir("/proc"):
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                except (OSError, IndexError):
                    continue
                if int(stat[1]) == os.getpid() and b"rootstock.worker" in cmdline:
                    found.append(cmdline[cmdline.index(b"--checkpoint") + 1].decode())
            return sorted(found)

        per_engine_worker = list(client.run(member_workers).values())
    finally:
        client.close(timeout=60)
        if client.cluster is not None:
            client.cluster.close(timeout=60)
    assert per_engine_worker == [sorted(PAIR)]  # one warm worker per member, reused
    for ours, theirs in zip(here, there, strict=True):
        assert set(ours) == set(theirs)
        assert theirs["energy"] == pytest.approx(ours["energy"], abs=1e-10)
        np.testing.assert_allclose(theirs["forces_std"], ours["forces_std"], **TIGHT)
        assert theirs["energy_std_relative"] == pytest.approx(
            ours["energy_std_relative"], abs=1e-10
        )
    assert again[1]["energy"] == pytest.approx(here[1]["energy"], abs=1e-10)


# --- faults ----------------------------------------------------------------------------------


def _kill_during_next_call(calc: CommitteeCalculator, member: str, atoms) -> threading.Timer:
    pid = calc.members[member].worker_pid
    assert pid is not None
    atoms.info["sleep"] = 60  # shifted-emt stalls on it; the sample EMT ignores info
    timer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def test_a_killed_member_raises_worker_died_naming_it_and_the_other_stays_up(fake_built_root):
    atoms = cu(seed=3)
    with committee(fake_built_root) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        emt_pid = calc.members["emt"].worker_pid
        timer = _kill_during_next_call(calc, "shifted-emt", atoms)
        with pytest.raises(WorkerDiedError, match="committee member 'shifted-emt'") as caught:
            atoms.get_potential_energy()
        timer.join()
        assert caught.value.worker_exit_code == -signal.SIGKILL
        assert calc.members["emt"].worker_pid == emt_pid and is_running(emt_pid)
        del atoms.info["sleep"]
        atoms.positions[0] += 0.02
        energy, _, _ = emt_results(atoms)
        assert atoms.get_potential_energy() == pytest.approx(energy + SHIFT / 2, abs=1e-10)
        assert calc.members["emt"].worker_pid == emt_pid  # the same warm worker


def test_with_drop_a_killed_member_is_dropped_and_the_run_goes_on(fake_built_root):
    atoms = cu(seed=4)
    with committee(fake_built_root, on_member_error="drop") as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        timer = _kill_during_next_call(calc, "shifted-emt", atoms)
        atoms.positions[1] += 0.02
        energy, _, _ = emt_results(atoms)
        assert atoms.get_potential_energy() == pytest.approx(energy, abs=1e-10)
        timer.join()
        assert calc.results["dropped"] == ["shifted-emt"] == calc.dropped
        assert calc.results["energy_std"] == 0.0 and calc.results["max_force_dev"] == 0.0
        assert isinstance(calc.member_errors["shifted-emt"], WorkerDiedError)
        del atoms.info["sleep"]
        VelocityVerlet(atoms, timestep=1.0, logfile=None).run(2)
        assert set(calc.results["members"]) == {"emt"}
        assert calc.results["dropped"] == ["shifted-emt"]


def test_a_failing_structure_in_a_batch_names_its_member(fake_built_root):
    images = [cu(seed=5), cu(seed=6)]
    images[1].info["fail"] = "no such element"
    with committee(fake_built_root, checkpoints=["plain-emt", "shifted-emt"]) as calc:
        results = calc.calculate_batch(images, errors="return")
        assert isinstance(results[1], rootstock.WorkerError)
        assert "committee member 'plain-emt'" in str(results[1])
        assert results[0]["energy_std_relative"] == pytest.approx(0.0, abs=1e-12)
        with pytest.raises(rootstock.WorkerError, match="structure 1"):
            calc.calculate_batch(images)


# --- lifecycle -------------------------------------------------------------------------------


def _started(calc: CommitteeCalculator) -> list[int]:
    atoms = cu(seed=7)
    calc.get_potential_energy(atoms)
    pids = [p for p in calc.worker_pids.values() if p is not None]
    assert len(pids) == len(calc.members) and all(is_running(p) for p in pids)
    return pids


def test_close_and_with_stop_every_member_worker(fake_built_root):
    calc = committee(fake_built_root)
    pids = _started(calc)
    calc.close()
    wait_gone(pids)
    assert calc.worker_pids == {m: None for m in PAIR}
    with committee(fake_built_root) as calc:
        pids = _started(calc)
    wait_gone(pids)


def test_garbage_collection_stops_every_member_worker(fake_built_root):
    calc = committee(fake_built_root)
    pids = _started(calc)
    del calc
    gc.collect()
    wait_gone(pids)


def test_a_killed_client_leaves_no_member_worker(fake_built_root):
    script = f"""
        from ase.build import bulk
        from rootstock import CommitteeCalculator
        calc = CommitteeCalculator({PAIR!r}, root={str(fake_built_root)!r}, device="cpu")
        atoms = bulk("Cu", cubic=True)
        atoms.calc = calc
        atoms.get_potential_energy()
        print(*calc.worker_pids.values(), flush=True)
        atoms.info["sleep"] = 300
        atoms.get_potential_energy()
        """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(90), "the client printed nothing in 90 s"
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, (line, proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(0.5)  # inside shifted-emt's sleep
        os.kill(proc.pid, signal.SIGKILL)
        wait_gone(pids, 10.0)
    finally:
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.communicate(timeout=30)


# --- concurrency -----------------------------------------------------------------------------


def test_members_compute_at_the_same_time(fake_built_root, tmp_path):
    trace = tmp_path / "trace.jsonl"
    knobs = {"delay": 0.5, "trace_file": str(trace)}
    members = ["plain-emt", "shifted-emt"]
    setup = {m: knobs for m in members}
    with committee(fake_built_root, checkpoints=members, setup_kwargs=setup) as calc:
        atoms = cu(seed=8)
        calc.get_potential_energy(atoms)  # starts both workers
        trace.unlink()
        atoms.positions[0] += 0.01
        started = time.monotonic()
        calc.get_potential_energy(atoms)
        wall = time.monotonic() - started
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sorted(r["checkpoint"] for r in records) == sorted(members)
    # Each member slept 0.5 s inside its calculation: the two intervals overlap.
    assert max(r["start"] for r in records) < min(r["end"] for r in records), records
    assert wall < 0.95, f"a committee call of two 0.5 s members took {wall:.2f} s"


# --- watch ------------------------------------------------------------------------------------


def test_watch_raises_past_the_threshold_and_writes_frames_with_a_trajectory(
    fake_built_root, tmp_path
):
    with committee(fake_built_root) as calc:
        atoms = cu(seed=9)
        atoms.calc = calc
        atoms.get_forces()
        dev = calc.results["max_force_dev"]
        calm = VelocityVerlet(atoms, timestep=1.0, logfile=None)
        calm.attach(watch(calc, max_force_dev=100 * dev))
        calm.run(2)  # far below the threshold: no raise
        md = VelocityVerlet(atoms, timestep=1.0, logfile=None)
        md.attach(watch(calc, max_force_dev=dev / 10))
        with pytest.raises(UncertaintyExceeded, match="max_force_dev") as caught:
            md.run(5)
        assert caught.value.exceeded == ("max_force_dev",)
        assert caught.value.spreads["max_force_dev"] > dev / 10
        np.testing.assert_allclose(caught.value.atoms.positions, atoms.positions, **TIGHT)

        path = tmp_path / "uncertain.traj"
        keeper = watch(calc, max_force_dev=dev / 10, trajectory=path)
        md = VelocityVerlet(atoms, timestep=1.0, logfile=None)
        md.attach(keeper)
        md.run(3)
        frames = read(path, index=":")
        assert len(frames) == keeper.frames == 4  # the start, then every step
        np.testing.assert_allclose(frames[-1].positions, atoms.positions, **TIGHT)
        np.testing.assert_allclose(frames[-1].get_forces(), atoms.get_forces(), **TIGHT)
        assert frames[-1].info["committee"]["max_force_dev"] == pytest.approx(
            calc.results["max_force_dev"]
        )


# --- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("checkpoints", "kwargs", "match"),
    [
        ([], {}, "at least one checkpoint"),
        ("emt", {}, "list of checkpoint ids"),
        (["emt", "emt"], {}, "more than once"),
        (PAIR, {"reference": "chgnet-0.3.0"}, "not a member"),
        (PAIR, {"weights": {"mace:custom": "model.pt"}}, "not a member"),
        (PAIR, {"setup_kwargs": {"delay": 1.0}}, "not a member"),
        (PAIR, {"on_member_error": "ignore"}, "'raise' or 'drop'"),
        (PAIR, {"checkpoint": "emt"}, "unknown keyword"),
        (PAIR, {"no_such_option": 1}, "unknown keyword"),
        (["emt", "no-such-checkpoint"], {}, "no-such-checkpoint"),
    ],
)
def test_bad_arguments_are_usage_errors(fake_built_root, checkpoints, kwargs, match):
    with pytest.raises(UsageError, match=match):
        committee(fake_built_root, checkpoints=checkpoints, **kwargs)


def test_bad_evaluate_and_watch_arguments_are_usage_errors(fake_built_root):
    images = [cu()]
    with pytest.raises(UsageError, match="cannot use executor"):
        rootstock.evaluate(images, checkpoints=PAIR, root=fake_built_root, executor=object())
    with pytest.raises(UsageError, match="not both"):
        rootstock.evaluate(images, "emt", checkpoints=PAIR, root=fake_built_root)
    with pytest.raises(UsageError, match="needs a checkpoint"):
        rootstock.evaluate(images, root=fake_built_root)
    calc = committee(fake_built_root)
    with pytest.raises(UsageError, match="at least one threshold"):
        watch(calc, max_force_dev=None)
    with pytest.raises(UsageError, match="CommitteeCalculator"):
        watch(RootstockCalculator("emt", root=fake_built_root, device="cpu"))
