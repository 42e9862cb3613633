"""Malformed on purpose: a CHECKPOINT_INFO entry is a string, not a dict of fields."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

CHECKPOINT_INFO = {
    "toy-1": "MIT",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
