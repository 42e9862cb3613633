"""What models return beyond energy, forces and stress, the model's dtype, and bad
user weights, through RootstockCalculator with a real worker.

EMT fills ``energies`` (and advertises, but never fills, ``magmoms``); the
``extras-emt`` test env also fills ``magmoms``, ``charges`` and ``dipole``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.errors import UsageError, WorkerError
from tests.integration.conftest import TEST_ENVS, build_real_root

# The first test also waits for the session's env builds (real uv), hence 600 s.
pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(600)]

EXTRAS_ENV = TEST_ENVS / "extras_emt.py"
BASE = ("energy", "free_energy", "forces", "stress")
TIGHT = {"rtol": 0, "atol": 1e-10}


@pytest.fixture(scope="module")
def extras_root(tmp_path_factory, shared_uv_cache: Path) -> Path:
    """A root with the extras-emt test env, built by real uv."""
    root = tmp_path_factory.mktemp("extras") / "root"
    return build_real_root(root, {"extras-emt": EXTRAS_ENV}, shared_uv_cache)


def extras_of(positions: np.ndarray, noncollinear: bool = False) -> dict[str, np.ndarray]:
    """The extras-emt formulas, run here (the env file needs only numpy)."""
    spec = importlib.util.spec_from_file_location("extras_emt_reference", EXTRAS_ENV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extras_of(positions, noncollinear)


def cu_bulk(seed: int = 0) -> Atoms:
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=seed)
    return atoms


def force_calls(calc: RootstockCalculator) -> int:
    """Round trips to the worker so far (what the usage record counts)."""
    return calc._session.usage.force_calls


# --- EMT's per-atom energies ----------------------------------------------------------


def test_emt_energies_match_in_process_and_dtype_is_float64(fake_built_root):
    atoms = cu_bulk()
    with RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as calc:
        assert calc.model_dtype is None
        assert tuple(calc.implemented_properties) == BASE
        atoms.calc = calc
        for step in range(3):
            ref = atoms.copy()
            ref.calc = EMT()
            # The first call on a fresh calculator: one calculation learns and answers.
            np.testing.assert_allclose(
                atoms.get_potential_energies(), ref.get_potential_energies(), **TIGHT
            )
            assert atoms.get_potential_energy() == pytest.approx(
                ref.get_potential_energy(), abs=1e-10
            )
            atoms.positions[step] += 0.02
        assert force_calls(calc) == 3
        assert calc.model_dtype == "float64"
        assert "energies" in calc.implemented_properties
        assert "magmoms" not in calc.implemented_properties  # advertised by EMT, never filled
    assert tuple(RootstockCalculator.implemented_properties) == BASE


def test_emt_refuses_magmoms_while_another_calculator_has_them(fake_built_root, extras_root):
    atoms = cu_bulk()
    with (
        RootstockCalculator(root=extras_root, checkpoint="extras-emt", device="cpu") as extras,
        RootstockCalculator(root=fake_built_root, checkpoint="emt", device="cpu") as emt,
    ):
        atoms.calc = extras
        np.testing.assert_allclose(
            atoms.get_magnetic_moments(), extras_of(atoms.positions)["magmoms"], **TIGHT
        )
        other = atoms.copy()
        other.calc = emt
        with pytest.raises(PropertyNotImplementedError):
            other.get_magnetic_moments()  # fresh: starts the worker, then refuses
        with pytest.raises(PropertyNotImplementedError):
            other.get_magnetic_moments()  # known now: refused without a calculation
        assert force_calls(emt) == 1
        assert "magmoms" not in emt.implemented_properties
        assert "magmoms" in extras.implemented_properties
        # A refused extra leaves the calculator working, with nothing more requested.
        ref = other.copy()
        ref.calc = EMT()
        other.positions[0] += 0.01
        ref.positions[0] += 0.01
        assert other.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)


# --- an env that fills magmoms, charges and dipole ------------------------------------


def test_first_call_magmoms_then_charges_and_dipole(extras_root):
    atoms = cu_bulk(seed=1)
    with RootstockCalculator(root=extras_root, checkpoint="extras-emt", device="cpu") as calc:
        atoms.calc = calc
        magmoms = atoms.get_magnetic_moments()  # the very first call
        assert force_calls(calc) == 1
        expected = extras_of(atoms.positions)
        np.testing.assert_allclose(magmoms, expected["magmoms"], **TIGHT)
        assert magmoms.shape == (len(atoms),)
        assert set(calc.implemented_properties) == {
            *BASE,
            "magmoms",
            "charges",
            "dipole",
            "energies",
        }
        assert calc.model_dtype == "float64"
        ref = atoms.copy()
        ref.calc = EMT()
        assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(atoms.get_charges(), expected["charges"], **TIGHT)
        np.testing.assert_allclose(atoms.get_dipole_moment(), expected["dipole"], **TIGHT)
        # Asked for once, kept: an MD-like loop gets all three in one round trip per step.
        for step in range(3):
            atoms.positions[step] += 0.02
            before = force_calls(calc)
            expected = extras_of(atoms.positions)
            np.testing.assert_allclose(atoms.get_magnetic_moments(), expected["magmoms"], **TIGHT)
            np.testing.assert_allclose(atoms.get_charges(), expected["charges"], **TIGHT)
            np.testing.assert_allclose(atoms.get_dipole_moment(), expected["dipole"], **TIGHT)
            atoms.get_forces()
            assert force_calls(calc) == before + 1


def test_noncollinear_magmoms_on_a_molecule(extras_root):
    atoms = molecule("CH4")
    atoms.center(vacuum=3.0)
    with RootstockCalculator(
        root=extras_root,
        checkpoint="extras-emt",
        device="cpu",
        setup_kwargs={"noncollinear": True},
    ) as calc:
        atoms.calc = calc
        magmoms = atoms.get_magnetic_moments()
    assert magmoms.shape == (len(atoms), 3)
    np.testing.assert_allclose(magmoms, extras_of(atoms.positions, True)["magmoms"], **TIGHT)


def test_an_extra_filled_only_on_request_is_found(extras_root):
    atoms = cu_bulk(seed=2)
    with RootstockCalculator(
        root=extras_root, checkpoint="extras-emt", device="cpu", setup_kwargs={"lazy": True}
    ) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()  # charges not asked for here ...
        assert "charges" in calc.implemented_properties  # ... but the model showed them
        np.testing.assert_allclose(
            atoms.get_charges(), extras_of(atoms.positions)["charges"], **TIGHT
        )


def test_a_malformed_extra_is_a_clear_error_and_is_not_asked_again(extras_root):
    atoms = cu_bulk(seed=3)
    with RootstockCalculator(
        root=extras_root,
        checkpoint="extras-emt",
        device="cpu",
        setup_kwargs={"malformed": "magmoms"},
    ) as calc:
        atoms.calc = calc
        energy = atoms.get_potential_energy()  # nothing asks for the bad extra yet
        with pytest.raises(WorkerError, match=r"'magmoms' has shape \(31,\), expected \(32,\)"):
            atoms.get_magnetic_moments()
        pid = calc.worker_pid
        atoms.positions[0] += 0.01
        assert atoms.get_potential_energy() != energy
        assert calc.worker_pid == pid


# --- bad user weights -----------------------------------------------------------------


def test_weights_the_family_cannot_load_name_the_path_and_its_error(fake_built_root, tmp_path):
    weights = tmp_path / "offset.json"
    weights.write_text("this is not JSON")
    atoms = cu_bulk()
    with RootstockCalculator(
        root=fake_built_root, checkpoint="emt-offset:custom", weights=weights, device="cpu"
    ) as calc:
        atoms.calc = calc
        with pytest.raises(WorkerError) as caught:
            atoms.get_potential_energy()
    err = caught.value
    assert f"weights file {weights}" in str(err)
    assert "JSONDecodeError" in err.message
    assert "setup_from_path" in err.remote_traceback  # the family's own frames are kept
    assert "json.load" in err.remote_traceback
    assert "weights" in err.hint


def test_a_weights_directory_is_named_as_one(fake_built_root, tmp_path):
    weights = tmp_path / "model-dir"
    weights.mkdir()
    with (
        RootstockCalculator(
            root=fake_built_root, checkpoint="emt-offset:custom", weights=weights, device="cpu"
        ) as calc,
        pytest.raises(WorkerError, match=f"weights directory {weights}"),
    ):
        calc.get_potential_energy(cu_bulk())


def test_good_weights_still_load(fake_built_root, tmp_path):
    weights = tmp_path / "offset.json"
    weights.write_text(json.dumps({"offset": 2.5}))
    atoms = cu_bulk()
    ref = atoms.copy()
    ref.calc = EMT()
    with RootstockCalculator(
        root=fake_built_root, checkpoint="emt-offset:custom", weights=weights, device="cpu"
    ) as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(
            ref.get_potential_energy() + 2.5, abs=1e-10
        )


def test_missing_weights_fail_at_construction(fake_built_root, tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        RootstockCalculator(
            root=fake_built_root, checkpoint="emt-offset:custom", weights=tmp_path / "nowhere"
        )
