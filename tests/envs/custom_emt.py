"""Test env with user weights: a "weights file" is JSON ``{"offset": eV}`` for EMT."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"emt-offset-0": "0", "emt-offset:custom": None}


def _offset_emt(offset):
    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    class OffsetEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, list(properties), system_changes)
            self.results["energy"] += offset
            self.results["free_energy"] += offset

    return OffsetEMT()


def setup(checkpoint, device="cuda", **kw):
    """The registered checkpoint: plain EMT (offset 0)."""
    return _offset_emt(float(CHECKPOINTS[checkpoint]))


def setup_from_path(path, device="cuda", **kw):
    """Load the offset from the user's weights file."""
    import json

    with open(path) as fh:
        return _offset_emt(float(json.load(fh)["offset"]))
