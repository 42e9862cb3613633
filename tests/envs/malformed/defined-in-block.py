"""Malformed on purpose: VERIFY_KWARGS defined inside try."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

try:
    VERIFY_KWARGS = {"toy-1": {"task": "omat"}}
except Exception:
    pass


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
