"""Malformed on purpose: CHECKPOINT_INFO is a list, not a dict of ids."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

CHECKPOINT_INFO = [
    {"licence": "MIT"},
]


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
