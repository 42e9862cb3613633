"""Small EMT structures the runtime tests compute, and the energies ASE's EMT gives them.

Each structure is rattled with a fixed seed, so a test's numbers are the same at
every run; two seeds give two different systems of the same species and size.
"""

from __future__ import annotations

from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT

#: How far (Å) every structure here is rattled off its lattice.
RATTLE = 0.05


def cu(repeat: int | tuple[int, int, int] = (2, 1, 1), seed: int = 0, a: float = 3.62) -> Atoms:
    """Cubic fcc Cu (4 atoms a cell), repeated ``repeat`` times, rattled by ``seed``.

    The default is 8 atoms; ``cu(2)`` is the 32-atom 2x2x2 cell, ``cu(1)`` one cell.
    """
    atoms = bulk("Cu", "fcc", a=a, cubic=True) * repeat
    atoms.rattle(RATTLE, seed=seed)
    return atoms


def al(seed: int = 1) -> Atoms:
    """Two cubic fcc Al cells (8 atoms), rattled by ``seed``."""
    atoms = bulk("Al", "fcc", a=4.05, cubic=True).repeat((2, 1, 1))
    atoms.rattle(RATTLE, seed=seed)
    return atoms


def emt_energy(atoms: Atoms, **emt_kwargs: object) -> float:
    """The energy ASE's own EMT gives ``atoms`` in this process (``emt_kwargs``: EMT's)."""
    copy = atoms.copy()
    copy.calc = EMT(**emt_kwargs)
    return float(copy.get_potential_energy())
