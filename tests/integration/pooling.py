"""Helpers for the pool's tests: small EMT structures, their reference energies, and
pooled calculators on a test root."""

from __future__ import annotations

import time
from pathlib import Path

from ase.build import bulk
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator


def cu(seed: int = 0):
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.rattle(0.05, seed=seed)
    return atoms


def al(seed: int = 1):
    atoms = bulk("Al", "fcc", a=4.05, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.05, seed=seed)
    return atoms


def emt_energy(atoms) -> float:
    ref = atoms.copy()
    ref.calc = EMT()
    return ref.get_potential_energy()


def pooled(root: Path, checkpoint: str = "emt", **kwargs) -> RootstockCalculator:
    return RootstockCalculator(checkpoint, root=root, device="cpu", pool=True, **kwargs)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)
