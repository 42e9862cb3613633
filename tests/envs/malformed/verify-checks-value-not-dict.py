"""Malformed on purpose: a VERIFY_CHECKS entry is a string, not a dict."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23", "numpy"]
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}

VERIFY_CHECKS = {
    "toy-1": "direct",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
