"""The worker's model side, in-process: env-source loading and ModelRunner paths."""

from __future__ import annotations

import os

import numpy as np
import pytest
from ase.build import bulk, molecule
from ase.calculators.calculator import BaseCalculator, Calculator, all_changes
from ase.calculators.emt import EMT

from rootstock.worker.model import ModelRunner, load_env_source, make_calculator

pytestmark = pytest.mark.timeout(60)

ENV_TEMPLATE = """
CHECKPOINTS = {{"m": "x"}}

def setup(checkpoint, device="cuda", **kw):
    return {value!r}
"""


def config_for(atoms, **extra):
    return {
        "rootstock": 1,
        "numbers": atoms.numbers.tolist(),
        "pbc": atoms.pbc.tolist(),
        "info": {},
        **extra,
    }


def test_env_source_is_compiled_afresh_even_with_the_same_size_and_mtime(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(ENV_TEMPLATE.format(value="aaaa"))
    stamp = os.stat(path)
    assert load_env_source(path).setup("m") == "aaaa"
    path.write_text(ENV_TEMPLATE.format(value="bbbb"))  # same size ...
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # ... and same mtime
    assert load_env_source(path).setup("m") == "bbbb"
    assert not (tmp_path / "__pycache__").exists()


def test_setup_must_return_a_calculator(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(ENV_TEMPLATE.format(value="not a calculator"))
    with pytest.raises(TypeError, match="not an ASE calculator"):
        make_calculator(load_env_source(path), "m", "cpu", {})


def test_weights_need_setup_from_path(tmp_path):
    path = tmp_path / "env_source.py"
    path.write_text(ENV_TEMPLATE.format(value=1))
    with pytest.raises(AttributeError, match="setup_from_path"):
        make_calculator(load_env_source(path), "m:custom", "cpu", {}, weights="w.pt")


def run_steps(runner, atoms, steps=4):
    out = []
    for step in range(steps):
        atoms.positions[step % len(atoms)] += 0.01
        if step == 2:
            atoms.cell[0, 0] += 0.05
        out.append(runner.compute(atoms.cell.array.copy(), atoms.positions.copy()))
    return out


def reference(atoms):
    ref = atoms.copy()
    ref.calc = EMT()
    return (
        ref.get_potential_energy(),
        ref.get_forces(),
        -ref.get_volume() * ref.get_stress(voigt=False),
    )


def test_direct_path_matches_the_public_ase_path():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=1)
    runner = ModelRunner(EMT())
    assert runner._direct
    runner.configure(config_for(atoms, stress=True))
    work = atoms.copy()
    energy, forces, virial, _ = run_steps(runner, work)[-1]
    ref_e, ref_f, ref_v = reference(work)
    assert energy == pytest.approx(ref_e, abs=1e-12)
    np.testing.assert_allclose(forces, ref_f, atol=1e-12)
    np.testing.assert_allclose(virial, ref_v, atol=1e-12)


class EnergyFirst(BaseCalculator):
    """A calculator with its own property plumbing (not an ase Calculator)."""

    implemented_properties = ("energy", "forces")

    def __init__(self):
        super().__init__()
        self.inner = EMT()

    def calculate(self, atoms, properties, system_changes):
        self.inner.calculate(atoms, properties, system_changes)
        self.results = dict(self.inner.results)


class LazyForces(Calculator):
    """Computes only what it is asked for: the worker must fill in the rest."""

    implemented_properties = ("energy", "forces")

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        inner = EMT()
        inner.calculate(self.atoms, ["energy", "forces"], all_changes)
        self.results = {"energy": inner.results["energy"]}
        if "forces" in properties and "energy" not in properties:
            self.results["forces"] = inner.results["forces"]


@pytest.mark.parametrize("calc", [EnergyFirst(), LazyForces()])
def test_calculators_with_their_own_plumbing_take_the_public_path(calc):
    atoms = molecule("CO")
    atoms.center(vacuum=3.0)
    runner = ModelRunner(calc)
    runner.configure(config_for(atoms))
    energy, forces, _virial, _ = runner.compute(atoms.cell.array, atoms.positions)
    ref = atoms.copy()
    ref.calc = EMT()
    assert energy == pytest.approx(ref.get_potential_energy(), abs=1e-12)
    np.testing.assert_allclose(forces, ref.get_forces(), atol=1e-12)


def test_info_reaches_the_model_and_a_new_config_resets_its_cache():
    seen = []

    class InfoEcho(Calculator):
        implemented_properties = ("energy", "forces")

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            seen.append(dict(atoms.info))
            self.results = {
                "energy": float(atoms.info.get("charge", 0)),
                "forces": np.zeros((len(atoms), 3)),
            }

    atoms = molecule("H2O")
    runner = ModelRunner(InfoEcho())
    runner.configure(config_for(atoms, info={"charge": 1}))
    assert runner.compute(atoms.cell.array, atoms.positions)[0] == 1
    runner.configure(config_for(atoms, info={"charge": -2}))
    assert runner.compute(atoms.cell.array, atoms.positions)[0] == -2
    assert seen == [{"charge": 1}, {"charge": -2}]


def test_standard_mode_tolerates_a_model_without_stress():
    class NoStress(EMT):
        implemented_properties = ("energy", "forces")

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    runner = ModelRunner(NoStress())
    runner.use_template(atoms)
    _, _, virial, _ = runner.compute(atoms.cell.array, atoms.positions)
    assert not virial.any()


def test_positions_without_species_explain_the_structure_flag():
    runner = ModelRunner(EMT())
    with pytest.raises(RuntimeError, match="--structure"):
        runner.compute(np.eye(3), np.zeros((1, 3)))
