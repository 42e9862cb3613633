"""Forces and stress against the energy (rootstock.ops.consistency), with in-process EMT.

EMT is conservative and float64, so its own ratios sit at 1 to many digits; the
wrappers below break it the ways real models get broken (a unit, a sign, a direct
head that only approximates the gradient) and the check must say which and how.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes
from ase.calculators.emt import EMT

from rootstock.install.envtables import VERIFY_CHECK_MODES
from rootstock.ops.consistency import (
    CHECK_MODES,
    GPA_PER_EV_A3,
    RATIO_TOLERANCE,
    check_consistency,
    dtype_rule,
)
from rootstock.ops.verify import default_reference

pytestmark = pytest.mark.timeout(60)


class BrokenEMT(Calculator):
    """EMT with its forces and stress changed after the fact (the energy is EMT's)."""

    implemented_properties: ClassVar[list[str]] = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, force_scale=1.0, stress_scale=1.0, force_noise=0.0, seed=1):
        super().__init__()
        self.inner = EMT()
        self.force_scale = force_scale
        self.stress_scale = stress_scale
        self.force_noise = force_noise
        self.rng = np.random.default_rng(seed)
        self.energy_calls = 0

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        self.energy_calls += 1
        work = self.atoms.copy()
        work.calc = self.inner
        forces = work.get_forces() * self.force_scale
        forces = forces + self.force_noise * self.rng.standard_normal(forces.shape)
        self.results = {
            "energy": work.get_potential_energy(),
            "free_energy": work.get_potential_energy(),
            "forces": forces,
        }
        if self.atoms.pbc.all():
            self.results["stress"] = work.get_stress() * self.stress_scale


def reference() -> Atoms:
    spec = default_reference()
    return Atoms(spec["symbols"], positions=spec["positions"], cell=spec["cell"], pbc=True)


def molecule() -> Atoms:
    atoms = reference()
    atoms.pbc = False
    return atoms


def test_emt_is_consistent_to_many_digits():
    atoms = reference()
    before = atoms.get_positions().copy(), atoms.get_cell().array.copy()
    report = check_consistency(atoms, EMT(), dtype="float64")
    assert report.ok and report.message is None
    assert report.dtype == "float64" and report.step == 1e-3
    forces, stress = report.checks["forces"], report.checks["stress"]
    assert forces.mode == stress.mode == "gradient"
    assert forces.ratio == pytest.approx(1.0, abs=1e-4)
    assert stress.ratio == pytest.approx(1.0, abs=1e-4)
    assert forces.directions == 3 and stress.directions == 1
    assert report.energy_calls == 8  # 3 displacements and 1 strain, each up and down
    # The structure it was given is left alone.
    assert np.array_equal(atoms.get_positions(), before[0])
    assert np.array_equal(atoms.get_cell().array, before[1])


def test_report_dict_is_the_manifest_shape():
    doc = check_consistency(reference(), EMT(), dtype="float64").to_dict()
    assert set(doc) == {
        "ok", "dtype", "model_dtype", "step", "energy", "energy_calls", "forces", "stress",
    }  # fmt: skip
    assert doc["ok"] is True and doc["energy"] == "smooth" and doc["model_dtype"] == "float64"
    assert set(doc["forces"]) == {
        "mode", "ok", "ratio", "cosine", "norm_ratio", "tol", "directions", "message",
    }  # fmt: skip
    assert doc["forces"]["tol"] == {"ratio": 0.02, "rule": "float64"}
    assert doc["stress"]["ok"] is True and doc["stress"]["message"] is None


def test_stress_in_gpa_is_a_unit_error():
    report = check_consistency(reference(), BrokenEMT(stress_scale=GPA_PER_EV_A3), dtype="float64")
    assert not report.ok
    assert report.checks["forces"].ok and not report.checks["stress"].ok
    assert report.checks["stress"].ratio == pytest.approx(160.2, rel=1e-3)
    assert report.message.startswith(
        "stress is 160.2× the strain derivative of the energy: a unit error (GPa vs eV/Å³?)"
    )
    assert "allowed 1 ± 0.02 in float64" in report.message
    assert "forces" not in report.message


def test_flipped_forces_are_a_sign_error():
    report = check_consistency(reference(), BrokenEMT(force_scale=-1.0), dtype="float64")
    assert not report.ok and report.checks["stress"].ok
    assert report.checks["forces"].ratio == pytest.approx(-1.0, abs=1e-4)
    assert report.message.startswith("forces are -1× the negative gradient of the energy")
    assert ": a sign error" in report.message


def test_a_structure_that_is_not_3d_periodic_has_no_stress_check():
    report = check_consistency(molecule(), EMT(), dtype="float64")
    assert report.ok
    stress = report.checks["stress"]
    assert stress.mode == "n/a" and stress.ok and stress.ratio is None
    assert "not 3-D periodic" in stress.message
    assert report.energy_calls == 6
    assert report.to_dict()["stress"]["mode"] == "n/a"


def test_direct_forces_pass_the_loose_bound_and_fail_the_gradient_one():
    direct = BrokenEMT(force_scale=1.2, force_noise=0.01)
    strict = check_consistency(reference(), direct, dtype="float64")
    assert not strict.ok and not strict.checks["forces"].ok
    assert strict.checks["forces"].ratio == pytest.approx(1.2, abs=0.1)
    loose = check_consistency(reference(), direct, dtype="float64", modes={"forces": "direct"})
    assert loose.ok, loose.message
    forces = loose.checks["forces"]
    assert forces.mode == "direct" and forces.cosine > 0.99
    assert forces.tol == {"min_cosine": 0.9, "norm_ratio": [0.5, 2.0]}
    # The loose bound still catches a sign or a unit.
    flipped = check_consistency(
        reference(), BrokenEMT(force_scale=-1.2), dtype="float64", modes={"forces": "direct"}
    )
    assert not flipped.ok and "cosine -1.000" in flipped.message
    gpa = check_consistency(
        reference(),
        BrokenEMT(stress_scale=GPA_PER_EV_A3),
        dtype="float64",
        modes={"stress": "direct"},
    )
    assert not gpa.ok and "a unit error" in gpa.message
    assert gpa.checks["stress"].directions == 3


def test_non_smooth_energy_loosens_every_quantity():
    direct = BrokenEMT(force_scale=1.2, stress_scale=0.8)
    report = check_consistency(reference(), direct, dtype="float64", modes={"energy": "non-smooth"})
    assert report.ok, report.message
    assert report.to_dict()["energy"] == "non-smooth"
    assert all(check.tol["min_cosine"] == 0.9 for check in report.checks.values())


def test_float32_rule_allows_ten_percent():
    off = BrokenEMT(force_scale=1.05)
    assert not check_consistency(reference(), off, dtype="float64").ok
    report = check_consistency(reference(), off, dtype="float32")
    assert report.ok and report.dtype == "float32" and report.step == 1e-2
    assert report.checks["forces"].tol == {"ratio": 0.10, "rule": "float32"}
    assert not check_consistency(reference(), BrokenEMT(force_scale=1.15), dtype="float32").ok


@pytest.mark.parametrize(
    ("dtype", "device", "rule"),
    [
        ("float64", None, "float64"),
        ("float64", "cpu", "float64"),
        ("float64", "cuda:1", "float32"),  # TF32 matmuls: a GPU takes the float32 rule
        ("float64", "xpu", "float32"),
        ("float32", "cpu", "float32"),
        ("bfloat16", "cpu", "float32"),
        (None, "cpu", "float32"),  # unknown: the looser rule
    ],
)
def test_dtype_rule(dtype, device, rule):
    assert dtype_rule(dtype, device) == rule
    assert RATIO_TOLERANCE[rule] in (0.02, 0.10)


def test_device_selects_the_rule_in_the_report():
    report = check_consistency(reference(), EMT(), dtype="float64", device="cuda")
    assert report.dtype == "float32" and report.checks["forces"].tol["rule"] == "float32"
    assert report.ok


def test_check_modes_are_the_lint_table():
    assert CHECK_MODES is VERIFY_CHECK_MODES
    assert CHECK_MODES["forces"] == ("gradient", "direct")
    assert CHECK_MODES["energy"] == ("smooth", "non-smooth")


class JumpyEMT(BrokenEMT):
    """EMT whose energy jumps by ``jump`` eV just past the reference along ``w``.

    The forces stay EMT's: this is a neighbour cap's rank swap, which the model's
    own gradient never sees.
    """

    def __init__(self, reference_positions, jump=0.01):
        super().__init__()
        self.w = np.random.default_rng(7).standard_normal(reference_positions.shape)
        self.threshold = float(np.sum(self.w * reference_positions)) + 1e-6
        self.jump = jump

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        if float(np.sum(self.w * self.atoms.get_positions())) > self.threshold:
            self.results["energy"] += self.jump
            self.results["free_energy"] += self.jump


def test_a_jump_in_the_energy_fails_unless_declared_non_smooth():
    atoms = reference()
    jumpy = JumpyEMT(atoms.get_positions())
    smooth = check_consistency(atoms, jumpy, dtype="float64")
    assert not smooth.ok and not smooth.checks["forces"].ok
    assert abs(smooth.checks["forces"].ratio - 1) > 0.5
    declared = check_consistency(atoms, jumpy, dtype="float64", modes={"energy": "non-smooth"})
    assert declared.ok, declared.message
    assert declared.checks["forces"].ratio == pytest.approx(1.0, abs=0.05)
    # 3 strains, not 1; and two more calls for each direction that crossed the jump.
    assert declared.energy_calls >= smooth.energy_calls + 4 + 2
