"""Malformed on purpose: VERIFY_CHECKS gives forces a mode that does not exist."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

VERIFY_CHECKS = {
    "toy-1": {
        "forces": "predicted",
    },
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
