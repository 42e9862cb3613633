"""Test env: a CLUSTERS variant of ``emt`` for the test cluster, 10 eV above EMT."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"emt": "ase.calculators.emt.EMT"}
CLUSTERS = ["testcluster"]

VARIANT_OFFSET = 10.0


def setup(checkpoint, device="cuda", **kw):
    """EMT shifted by VARIANT_OFFSET, so a test can tell the variant was chosen."""
    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    class VariantEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, list(properties), system_changes)
            self.results["energy"] += VARIANT_OFFSET
            self.results["free_energy"] += VARIANT_OFFSET

    return VariantEMT(**kw)
