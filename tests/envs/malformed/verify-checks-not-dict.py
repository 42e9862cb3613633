"""Malformed on purpose: VERIFY_CHECKS is a list, not a dict."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

VERIFY_CHECKS = ["toy-1"]


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
