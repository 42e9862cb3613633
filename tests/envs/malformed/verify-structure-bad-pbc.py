"""Malformed on purpose: VERIFY_STRUCTURE pbc is a string."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

VERIFY_STRUCTURE = {
    "symbols": "Cu",
    "positions": [[0.0, 0.0, 0.0]],
    "cell": [[3.6, 0.0, 0.0], [0.0, 3.6, 0.0], [0.0, 0.0, 3.6]],
    "pbc": "yes",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
