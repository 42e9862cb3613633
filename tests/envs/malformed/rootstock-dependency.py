"""Malformed on purpose: rootstock listed as a dependency by name."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "rootstock>=0.1"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
