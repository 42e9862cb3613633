"""Malformed on purpose: the PEP 723 block lists no dependencies."""

# /// script
# requires-python = ">=3.11"
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
