"""Test env: EMT that also fills ASE's extras ``magmoms``, ``charges`` and ``dipole``.

The extras are made-up smooth functions of the positions (see :func:`extras_of`),
so a test can recompute them in-process. ``setup()`` keywords (tests only):
``noncollinear`` (magmoms of shape (n, 3)), ``lazy`` (charges and dipole only
when asked for, as some calculators do) and ``malformed`` (the name of an extra
to return with a wrong shape).
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"extras-emt": "emt-with-extras"}


def extras_of(positions, noncollinear=False):
    """The extras for these positions (Å): magmoms, charges (summing to 0), dipole."""
    import numpy as np

    magmoms = np.sin(positions[:, 0]) + 0.5
    if noncollinear:
        magmoms = np.stack([magmoms, np.cos(positions[:, 1]), 0.1 * positions[:, 2]], axis=1)
    charges = np.tanh(positions[:, 1] - positions[:, 1].mean())
    charges -= charges.mean()
    dipole = charges @ positions
    return {"magmoms": magmoms, "charges": charges, "dipole": dipole}


def setup(checkpoint, device="cuda", noncollinear=False, lazy=False, malformed=None, **kw):
    """Return EMT whose results also hold magmoms, charges and dipole."""
    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    class ExtrasEMT(EMT):
        implemented_properties = (*EMT.implemented_properties, "charges", "dipole")

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, list(properties), system_changes)
            extras = extras_of(self.atoms.positions, noncollinear)
            if lazy:
                extras = {k: v for k, v in extras.items() if k == "magmoms" or k in properties}
            if malformed in extras:
                extras[malformed] = extras[malformed][:-1]
            self.results.update(extras)

    return ExtrasEMT(**kw)
