"""RootstockCalculator as an ASE calculator: results equal the in-process model."""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms, units
from ase.build import bulk, fcc111, molecule
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.emt import EMT
from ase.filters import FrechetCellFilter
from ase.md.langevin import Langevin
from ase.optimize import BFGS

from rootstock import RootstockCalculator

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(180)]

TIGHT = {"rtol": 0, "atol": 1e-10}


def cu_bulk(repeat=(2, 2, 2), seed=0) -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * repeat
    atoms.rattle(0.05, seed=seed)
    return atoms


def alloy() -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True) * (2, 2, 1)
    atoms.numbers[::3] = 47  # Ag
    atoms.rattle(0.03, seed=4)
    return atoms


def reference(atoms: Atoms) -> dict:
    ref = atoms.copy()
    ref.calc = EMT()
    out = {"energy": ref.get_potential_energy(), "forces": ref.get_forces()}
    if ref.pbc.all():
        out["stress"] = ref.get_stress()
    return out


def assert_matches(atoms: Atoms) -> None:
    ref = reference(atoms)
    assert atoms.get_potential_energy() == pytest.approx(ref["energy"], abs=1e-10)
    assert atoms.get_potential_energy(force_consistent=True) == pytest.approx(
        ref["energy"], abs=1e-10
    )
    np.testing.assert_allclose(atoms.get_forces(), ref["forces"], **TIGHT)
    if "stress" in ref:
        np.testing.assert_allclose(atoms.get_stress(), ref["stress"], **TIGHT)


def test_emt_matches_in_process_and_stays_warm(fake_built_root):
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        assert calc.worker_pid is None  # started lazily
        atoms = cu_bulk()
        atoms.calc = calc
        assert_matches(atoms)
        pid = calc.worker_pid
        assert pid is not None
        for step in range(5):
            atoms.positions[step] += 0.01
            assert_matches(atoms)
        assert calc.worker_pid == pid
    assert calc.worker_pid is None


def test_composition_and_pbc_changes_between_calls(fake_built_root):
    systems = [cu_bulk(), alloy(), molecule("H2O"), cu_bulk((1, 1, 2), seed=2)]
    cluster = cu_bulk((1, 1, 1), seed=3)
    cluster.pbc = False
    cluster.center(vacuum=4.0)
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=5.0)
    systems += [cluster, slab]
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        pid = None
        for atoms in systems:
            atoms.calc = calc
            ref = reference(atoms)
            assert atoms.get_potential_energy() == pytest.approx(ref["energy"], abs=1e-10)
            np.testing.assert_allclose(atoms.get_forces(), ref["forces"], **TIGHT)
            pid = pid or calc.worker_pid
            assert calc.worker_pid == pid


def test_stress_only_for_3d_periodic_cells(fake_built_root):
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=5.0)  # pbc = (True, True, False)
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        slab.calc = calc
        slab.get_potential_energy()
        with pytest.raises(PropertyNotImplementedError, match="three directions"):
            slab.get_stress()
        atoms = cu_bulk()
        atoms.calc = calc
        np.testing.assert_allclose(atoms.get_stress(), reference(atoms)["stress"], **TIGHT)


def test_bfgs_with_a_cell_filter_follows_the_in_process_path(fake_built_root):
    def relax(calc) -> list[float]:
        atoms = cu_bulk(seed=5)
        atoms.set_cell(atoms.cell * 1.02, scale_atoms=True)
        atoms.calc = calc
        opt = BFGS(FrechetCellFilter(atoms), logfile=None)
        energies = []
        opt.attach(lambda: energies.append(atoms.get_potential_energy()))
        opt.run(fmax=1e-3, steps=25)
        return energies

    expected = relax(EMT())
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        got = relax(calc)
    assert len(got) == len(expected) > 5
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-8)


def test_langevin_md_follows_the_in_process_trajectory(fake_built_root):
    def run(calc) -> tuple[list[float], np.ndarray]:
        atoms = cu_bulk(seed=6)
        atoms.calc = calc
        md = Langevin(
            atoms,
            2 * units.fs,
            temperature_K=300,
            friction=0.01 / units.fs,
            fixcm=False,
            rng=np.random.default_rng(42),
        )
        energies = []
        md.attach(lambda: energies.append(atoms.get_potential_energy()))
        md.run(20)
        return energies, atoms.positions.copy()

    expected, expected_pos = run(EMT())
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        got, got_pos = run(calc)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-8)
    np.testing.assert_allclose(got_pos, expected_pos, rtol=0, atol=1e-8)


def test_info_is_forwarded_and_an_info_change_alone_recalculates(fake_built_root):
    shift = 0.75  # CHARGE_SHIFT in tests/envs/charge_emt.py
    atoms = cu_bulk()
    plain = reference(atoms)["energy"]
    with RootstockCalculator(root=fake_built_root, checkpoint="charge-emt", device="cpu") as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(plain, abs=1e-10)
        atoms.info["charge"] = 2
        assert atoms.get_potential_energy() == pytest.approx(plain + 2 * shift, abs=1e-10)
        atoms.info["charge"] = -1
        assert atoms.get_potential_energy() == pytest.approx(plain - shift, abs=1e-10)
        # Values that cannot be serialised are simply not forwarded.
        atoms.info["an_object"] = object()
        atoms.info["numpy_value"] = np.float32(1.5)
        assert atoms.get_potential_energy() == pytest.approx(plain - shift, abs=1e-10)
        del atoms.info["charge"]
        assert atoms.get_potential_energy() == pytest.approx(plain, abs=1e-10)


def test_forwarded_info_survives_a_composition_change(fake_built_root):
    shift = 0.75
    with RootstockCalculator(root=fake_built_root, checkpoint="charge-emt", device="cpu") as calc:
        for atoms in (cu_bulk(), alloy()):
            atoms.info["charge"] = 1
            atoms.calc = calc
            expected = reference(atoms)["energy"] + shift
            assert atoms.get_potential_energy() == pytest.approx(expected, abs=1e-10)
