"""Benchmark env: a null model that returns precomputed forces (no physics at all)."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"null": "precomputed"}


def make_null_calculator():
    """A calculator whose cost is only ASE's own bookkeeping."""
    import numpy as np
    from ase.calculators.calculator import Calculator, all_changes

    class NullCalculator(Calculator):
        implemented_properties = ("energy", "free_energy", "forces", "stress")

        def __init__(self):
            super().__init__()
            self._forces = {}

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            n = len(self.atoms)
            if n not in self._forces:
                self._forces[n] = np.random.default_rng(n).normal(size=(n, 3))
            self.results = {
                "energy": -1.0 * n,
                "free_energy": -1.0 * n,
                "forces": self._forces[n],
                "stress": np.zeros(6),
            }

    return NullCalculator()


def setup(checkpoint, device="cuda", **kw):
    """Return the null calculator."""
    return make_null_calculator()
