"""Malformed on purpose: VERIFY_KWARGS refers to a name."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

TASK = "omat"
VERIFY_KWARGS = {"toy-1": {"task": TASK}}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
