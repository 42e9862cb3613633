"""The worker's side of a BATCH, in-process: run_batch around ASE's EMT, with and without
an ``evaluate_batch`` hook, compared with the worker's own single-call path."""

from __future__ import annotations

import re

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.calculators.calculator import all_changes
from ase.calculators.emt import EMT

from rootstock.wire import batch as bw
from rootstock.wire import framing as p
from rootstock.worker.batch import run_batch
from rootstock.worker.model import ModelRunner

pytestmark = pytest.mark.timeout(60)


class ChargeEMT(EMT):
    """EMT plus 0.75 eV per unit of ``atoms.info["charge"]``: info alone changes results."""

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, list(properties), system_changes)
        shift = 0.75 * float(self.atoms.info.get("charge", 0.0))
        self.results["energy"] += shift
        self.results["free_energy"] += shift


def structures() -> list[Atoms]:
    cu = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 1, 1)
    cu.rattle(0.05, seed=1)
    alloy = bulk("Cu", "fcc", a=3.7, cubic=True)
    alloy.numbers[::2] = 47
    alloy.rattle(0.03, seed=2)
    alloy.info["charge"] = 2
    water = molecule("H2O")
    water.center(vacuum=4.0)
    uranium = bulk("Cu", "fcc", a=3.6)
    uranium.numbers[0] = 92  # EMT has no potential for U
    slab = bulk("Cu", "fcc", a=3.6, cubic=True)
    slab.pbc = (True, True, False)
    return [cu, alloy, water, uranium, slab]


def item_of(atoms: Atoms) -> bw.BatchItem:
    return bw.BatchItem(
        numbers=atoms.numbers, pbc=atoms.pbc, cell=atoms.cell.array,
        positions=atoms.positions, info=dict(atoms.info),
    )  # fmt: skip


def run(runner, hook, images, properties=("energy", "forces", "stress"), allow_nonfinite=False):
    request = bw.BatchRequest([item_of(a) for a in images], tuple(properties), allow_nonfinite)
    frame = run_batch(runner, hook, request)
    assert frame[:12] == p.BATCHREADY, frame[:200]
    return bw.decode_batchready_body(frame[16:], [len(a) for a in images])


def single(atoms: Atoms, stress: bool) -> tuple:
    """The worker's single-call path on a fresh runner: what a BATCH must reproduce."""
    runner = ModelRunner(ChargeEMT())
    runner.configure(
        {"numbers": atoms.numbers.tolist(), "pbc": atoms.pbc.tolist(), "info": atoms.info,
         "stress": stress}
    )  # fmt: skip
    return runner.compute(atoms.cell.array, atoms.positions)


def emt_hook(seen: list):
    def evaluate_batch(calc, atoms_list, properties):
        seen.append((len(atoms_list), properties))
        out = []
        for atoms in atoms_list:
            atoms.calc = calc
            try:
                entry = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
                if "stress" in properties:
                    entry["stress"] = atoms.get_stress()
                if "energies" in properties:
                    entry["energies"] = atoms.get_potential_energies()
            except Exception as exc:
                entry = exc
            out.append(entry)
        return out

    return evaluate_batch


@pytest.mark.parametrize("with_hook", [False, True])
def test_a_batch_equals_single_calls_and_names_the_failing_index(with_hook):
    images = structures()
    seen: list = []
    reply = run(ModelRunner(ChargeEMT()), emt_hook(seen) if with_hook else None, images)
    assert len(reply.results) == len(images)
    for i, (atoms, result) in enumerate(zip(images, reply.results, strict=True)):
        periodic = bool(atoms.pbc.all())
        if i == 3:
            assert isinstance(result, bw.ItemError)
            assert result.type == "NotImplementedError" and "U" in result.message
            continue
        energy, forces, virial, _ = single(atoms, periodic)
        assert result.energy == energy
        assert result.forces.tobytes() == forces.tobytes()
        if periodic:
            np.testing.assert_allclose(result.virial, virial, rtol=1e-14, atol=1e-14)
        else:
            assert result.virial is None
    # The report names the extras seen filled: the hook gave none, EMT's own path energies.
    filled = [] if with_hook else ["energies"]
    assert reply.model == {"dtype": "float64", "extras": filled, "device": "cpu"}
    if with_hook:
        # Stress is asked for only for the 3-D periodic structures, in a call of their own.
        assert seen == [(3, ("energy", "forces", "stress")), (2, ("energy", "forces"))]


def test_a_batch_leaves_the_single_call_system_intact():
    base = bulk("Cu", "fcc", a=3.62, cubic=True)
    runner = ModelRunner(ChargeEMT())
    runner.configure({"numbers": base.numbers.tolist(), "pbc": [True] * 3, "info": {}})
    before = runner.compute(base.cell.array, base.positions)
    # The same geometry but another charge: ASE's own comparison cannot tell them apart.
    twin = base.copy()
    twin.info["charge"] = 1
    reply = run(runner, None, [twin], ("energy",))
    assert reply.results[0].energy == pytest.approx(before[0] + 0.75)
    after = runner.compute(base.cell.array, base.positions)
    assert after[0] == before[0]
    assert after[1].tobytes() == before[1].tobytes()


def test_extras_travel_when_asked_and_match_the_model():
    images = structures()[:3]
    for hook in (None, emt_hook([])):
        reply = run(ModelRunner(EMT()), hook, images, ("energy", "energies"))
        for atoms, result in zip(images, reply.results, strict=True):
            ref = atoms.copy()
            ref.calc = EMT()
            np.testing.assert_allclose(
                result.extras["energies"], ref.get_potential_energies(), rtol=0, atol=1e-12
            )
            assert result.forces is None  # not asked for: not sent


def test_a_hook_that_fails_as_a_whole_is_rerun_one_structure_at_a_time():
    calls = []

    def evaluate_batch(calc, atoms_list, properties):
        calls.append(len(atoms_list))
        if any(92 in a.numbers for a in atoms_list):
            raise RuntimeError("unknown species in this batch")
        return emt_hook([])(calc, atoms_list, properties)

    images = structures()
    reply = run(ModelRunner(EMT()), evaluate_batch, images)
    assert calls == [3, 1, 1, 1, 2]  # periodic group fails whole, then one at a time
    errors = [i for i, r in enumerate(reply.results) if isinstance(r, bw.ItemError)]
    assert errors == [3]
    assert reply.results[3].message == "unknown species in this batch"
    assert "RuntimeError" in reply.results[3].traceback


@pytest.mark.parametrize(
    "returned, match",
    [
        (lambda n: None, "returned NoneType, not a list"),
        (lambda n: [{"energy": 0.0, "forces": np.zeros((1, 3))}], "returned 1 results"),
    ],
)
def test_a_hook_returning_the_wrong_shape_of_list_is_rerun_and_reported(returned, match):
    reply = run(ModelRunner(EMT()), lambda c, a, p: returned(len(a)), structures()[:2], ["energy"])
    for result in reply.results:
        if match.startswith("returned 1"):
            # One structure at a time, a list of one is the right length.
            assert isinstance(result, bw.ItemResult)
        else:
            assert isinstance(result, bw.ItemError) and match in result.message
            assert result.type == "MalformedResult" and result.traceback == ""


@pytest.mark.parametrize(
    "entry, kind, match",
    [
        ("garbage", "MalformedResult", "not a dict of results"),
        ({"forces": np.zeros((2, 3))}, "MalformedResult", "no 'energy'"),
        ({"energy": 1.0}, "MalformedResult", "no 'forces'"),
        ({"energy": 1.0, "forces": np.zeros((3, 3))}, "MalformedResult", r"expected \(2, 3\)"),
        ({"energy": np.nan, "forces": np.zeros((2, 3))}, "NonFiniteResult", "energy is nan"),
        ({"energy": "1", "forces": np.zeros((2, 3))}, "MalformedResult", "string"),
        (ValueError("model says no"), "ValueError", "model says no"),
    ],
)
def test_hook_entries_get_the_single_call_checks(entry, kind, match):
    atoms = Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.74]])
    reply = run(ModelRunner(EMT()), lambda c, a, p: [entry], [atoms], ("energy", "forces"))
    (result,) = reply.results
    assert isinstance(result, bw.ItemError)
    assert result.type == kind
    assert re.search(match, result.message), result.message


def test_allow_nonfinite_lets_nan_through_a_hook():
    atoms = Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.74]])
    entry = {"energy": np.nan, "forces": np.full((2, 3), np.inf)}
    reply = run(ModelRunner(EMT()), lambda c, a, p: [entry], [atoms], ("energy", "forces"), True)
    (result,) = reply.results
    assert np.isnan(result.energy) and np.isinf(result.forces).all()


def test_a_reply_too_large_to_encode_fails_the_batch_as_a_whole(monkeypatch):
    monkeypatch.setattr(bw, "MAX_PAYLOAD", 200)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    request = bw.BatchRequest([item_of(atoms)], ("energy", "forces"))
    frame = run_batch(ModelRunner(EMT()), None, request)
    assert frame[:12] == p.ERROR
    assert b"exceeds" in frame


class BufferReusingEMT(EMT):
    """Hands out one forces buffer, refilled in place at every call (as some models do)."""

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, list(properties), system_changes)
        buffer = getattr(type(self), "_buffer", None)
        if buffer is None or buffer.shape != self.results["forces"].shape:
            buffer = type(self)._buffer = np.empty_like(self.results["forces"])
        buffer[:] = self.results["forces"]
        self.results["forces"] = buffer


def test_results_are_copied_before_the_next_structure_refills_a_models_buffer():
    images = [bulk("Cu", "fcc", a=3.6, cubic=True) for _ in range(3)]
    for seed, atoms in enumerate(images):
        atoms.rattle(0.05, seed=seed)
    reply = run(ModelRunner(BufferReusingEMT()), None, images, ("energy", "forces"))
    for atoms, result in zip(images, reply.results, strict=True):
        ref = atoms.copy()
        ref.calc = EMT()
        np.testing.assert_allclose(result.forces, ref.get_forces(), rtol=0, atol=1e-12)


def test_a_run_of_one_system_is_one_trajectory_to_the_model_and_a_new_system_starts_clean():
    class CountingEMT(ChargeEMT):
        resets = 0

        def reset(self):
            CountingEMT.resets += 1
            super().reset()

    base = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 1, 1)
    images = []
    for seed, charge in ((1, 0), (2, 0), (3, 0), (4, 1), (5, 1)):
        atoms = base.copy()
        atoms.rattle(0.05, seed=seed)
        atoms.info["charge"] = charge
        images.append(atoms)
    runner = ModelRunner(CountingEMT())
    CountingEMT.resets = 0
    reply = run(runner, None, images)
    # One start for the charge-0 run, one for the charge-1 run, one after the batch.
    assert CountingEMT.resets == 3
    for atoms, result in zip(images, reply.results, strict=True):
        energy, forces, virial, _ = single(atoms, stress=True)
        assert result.energy == pytest.approx(energy, rel=1e-12)
        np.testing.assert_allclose(result.forces, forces, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(result.virial, virial, rtol=1e-10, atol=1e-12)
