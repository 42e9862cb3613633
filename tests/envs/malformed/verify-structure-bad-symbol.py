"""Malformed on purpose: VERIFY_STRUCTURE has a made-up element."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

VERIFY_STRUCTURE = {
    "symbols": ["Cu", "Qq"],
    "positions": [[0.0, 0.0, 0.0], [1.8, 1.8, 0.0]],
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
