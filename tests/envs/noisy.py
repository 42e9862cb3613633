"""Test env: a model that prints a lot (1 MB at setup, 128 KB per calculation)."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase"]
# ///

CHECKPOINTS = {"noisy": "emt-that-talks"}


def setup(checkpoint, device="cuda", **kw):
    """Print 1 MB (stdout and stderr), then return a chatty EMT."""
    import sys

    from ase.calculators.calculator import all_changes
    from ase.calculators.emt import EMT

    line = "x" * 1023
    for _ in range(768):
        print(line)
    for _ in range(256):
        print(line, file=sys.stderr)

    class NoisyEMT(EMT):
        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            for _ in range(128):
                print(line)
            super().calculate(atoms, list(properties), system_changes)

    return NoisyEMT(**kw)
