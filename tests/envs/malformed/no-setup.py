"""Malformed on purpose: no setup() function."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}


def make_calculator(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
