"""The calculator against an env really built by uv (the vendored worker, compiled bytecode)."""

from __future__ import annotations

import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator

pytestmark = [pytest.mark.usefixtures("runtime_isolation"), pytest.mark.timeout(900)]


def test_emt_through_a_uv_built_env_matches_in_process(emt_root):
    atoms = bulk("Cu", "fcc", a=3.62, cubic=True) * (2, 2, 2)
    atoms.rattle(0.05, seed=3)
    ref = atoms.copy()
    ref.calc = EMT()
    with RootstockCalculator(root=emt_root, checkpoint="emt", device="cpu") as calc:
        atoms.calc = calc
        assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=0, atol=1e-10)
        # The worker runs the env's own interpreter, not this one.
        with open(f"/proc/{calc.worker_pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
        assert argv[0].decode().startswith(str(emt_root / "envs" / "emt"))
