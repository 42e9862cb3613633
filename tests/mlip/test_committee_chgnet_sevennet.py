"""A committee of CHGNet and SevenNet equals the two run as separate calculators.

8 atoms, one single call and one two-structure batch. Both models run in float32,
so the comparison uses the float32 tolerance of the family tests.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1200)]

MEMBERS = ["chgnet-0.3.0", "sevennet-0"]
RTOL = 1e-5  # test_mlip_calculator.py's FLOAT32_RTOL: threaded float32 sums


def structures():
    from ase.build import bulk

    images = []
    for seed in (3, 4):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 1, 1)  # 8 atoms
        atoms.rattle(0.05, seed=seed)
        images.append(atoms)
    return images


def close(ours, theirs, what: str) -> None:
    scale = max(np.abs(np.asarray(theirs)).max(), 1e-3)
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def test_chgnet_and_sevennet_committee_equals_their_separate_calculators(mlip_root):
    from rootstock import CommitteeCalculator, RootstockCalculator

    images = structures()
    separate = {}
    for checkpoint in MEMBERS:
        with RootstockCalculator(checkpoint, root=mlip_root, device="cpu", shared=False) as calc:
            atoms = images[0].copy()
            atoms.calc = calc
            single = (atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress())
            separate[checkpoint] = (single, calc.calculate_batch(images))
    with CommitteeCalculator(MEMBERS, root=mlip_root, device="cpu") as committee:
        atoms = images[0].copy()
        atoms.calc = committee
        atoms.get_stress()
        results = committee.results
        batch = committee.calculate_batch(images)
    energies = np.array([separate[m][0][0] for m in MEMBERS])
    forces = np.array([separate[m][0][1] for m in MEMBERS])
    close(results["energy"], energies.mean(), "energy")
    close(results["energy_std"], energies.std(), "energy_std")
    close(results["forces"], forces.mean(axis=0), "forces")
    close(results["forces_std"], forces.std(axis=0), "forces_std")
    dev = np.sqrt(((forces - forces.mean(axis=0)) ** 2).sum(axis=2).mean(axis=0)).max()
    close(results["max_force_dev"], dev, "max_force_dev")
    for m in MEMBERS:
        close(results["members"][m]["stress"], separate[m][0][2], f"{m} stress")
    for i, got in enumerate(batch):
        for m in MEMBERS:
            close(got["members"][m]["energy"], separate[m][1][i]["energy"], f"{m} energy {i}")
            close(got["members"][m]["forces"], separate[m][1][i]["forces"], f"{m} forces {i}")
        first = [separate[m][1][i]["energy"] - separate[m][1][0]["energy"] for m in MEMBERS]
        assert got["energy_std_relative"] == pytest.approx(np.std(first), abs=1e-4)
