"""Malformed on purpose: VERIFY_CHECKS names an undeclared id."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

VERIFY_CHECKS = {
    "toy-2": {"forces": "direct"},
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
