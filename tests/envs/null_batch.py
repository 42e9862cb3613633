"""Benchmark env: the null model with an ``evaluate_batch`` hook (no physics at all).

The same precomputed results as tests/envs/null_model.py, and a hook that returns
them for a whole batch, so a pooled worker of this env takes merged calls
(``RSMERGE``): ``benchmarks/coalescing.py`` uses it to show what the merging relay
itself costs, as null_model.py shows the plain relay's cost.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase", "numpy"]
# ///

CHECKPOINTS = {"null-batch": "precomputed"}


def make_null_calculator():
    """A calculator whose cost is only ASE's own bookkeeping."""
    import numpy as np
    from ase.calculators.calculator import Calculator, all_changes

    class NullCalculator(Calculator):
        implemented_properties = ("energy", "free_energy", "forces", "stress")

        def __init__(self):
            super().__init__()
            self._forces = {}

        def forces_for(self, natoms):
            """The fixed forces of every ``natoms``-atom structure."""
            if natoms not in self._forces:
                self._forces[natoms] = np.random.default_rng(natoms).normal(size=(natoms, 3))
            return self._forces[natoms]

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            n = len(self.atoms)
            self.results = {
                "energy": -1.0 * n,
                "free_energy": -1.0 * n,
                "forces": self.forces_for(n),
                "stress": np.zeros(6),
            }

    return NullCalculator()


def setup(checkpoint, device="cuda", **kw):
    """Return the null calculator."""
    return make_null_calculator()


def evaluate_batch(calc, atoms_list, properties):
    """The null results of every structure, in one call."""
    import numpy as np

    results = []
    for atoms in atoms_list:
        n = len(atoms)
        result = {"energy": -1.0 * n, "forces": calc.forces_for(n)}
        if "stress" in properties:
            result["stress"] = np.zeros(6)
        results.append(result)
    return results
