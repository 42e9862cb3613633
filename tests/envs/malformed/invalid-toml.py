"""Malformed on purpose: the PEP 723 block is not TOML."""

# /// script
# requires-python = ">=3.11"
# dependencies = ["ase>=3.23"
# ///

CHECKPOINTS = {
    "toy-1": "toy",
}


def setup(checkpoint, device="cuda", **kw):
    from ase.calculators.emt import EMT

    return EMT()
