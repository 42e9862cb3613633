"""Malformed on purpose: setup() takes no device."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}


def setup(checkpoint):
    from ase.calculators.emt import EMT

    return EMT()
